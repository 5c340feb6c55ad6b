"""Shared fixtures: tiny in-process models, an offline tokenizer, a GSM8K slice; no network ever."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO.parent / "shared" / "data") if (REPO.parent / "shared" / "data").is_dir() else None


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data (GSM8K, MATH-500, IHEval). Tests needing the full sets skip only if it is absent."""
    if SHARED_DATA is None:
        pytest.skip("../shared/data is not present on this machine")
    return SHARED_DATA


@pytest.fixture()
def one_torch_thread():
    """One torch thread for the test: its tensors are tiny, and more threads only add contention on a shared CPU."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from llmkit.testing import tiny_tokenizer as make

    return make()


@pytest.fixture()
def tiny_model():
    from llmkit.testing import tiny_llama

    return tiny_llama()


GSM8K_SLICE = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
        "in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
        "How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
        "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    },
    {
        "question": "Betty is saving money for a new wallet which costs $100. Betty has only half of the money "
        "she needs. Her parents decided to give her $15 for that purpose, and her grandparents twice as "
        "much as her parents. How much more money does Betty need to buy the wallet?",
        "answer": "In the beginning, Betty has only 100 / 2 = $<<100/2=50>>50.\nBetty's grandparents gave "
        "her 15 * 2 = $<<15*2=30>>30.\nThis means, Betty needs 100 - 50 - 30 - 15 = $<<100-50-30-15=5>>5 "
        "more.\n#### 5",
    },
    {
        "question": "James writes a 3-page letter to 2 different friends twice a week.  How many pages does "
        "he write a year?",
        "answer": "He writes each friend 3*2=<<3*2=6>>6 pages a week\nSo he writes 6*2=<<6*2=12>>12 pages "
        "every week\nThat means he writes 12*52=<<12*52=624>>624 pages a year\n#### 624",
    },
]


@pytest.fixture()
def gsm8k_slice(tmp_path) -> Path:
    """A 4-problem GSM8K file in the original JSONL format."""
    p = tmp_path / "gsm8k_slice.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_SLICE))
    return p


@pytest.fixture(scope="session")
def bundled():
    """The real bundled model (smollm2-135m-instruct), loaded once per session. Mark users @pytest.mark.bundled."""
    from llmkit.models import load

    return load("smollm2-135m-instruct")


class Launch:
    """One ``accelerate launch`` run: exit code, output, and the world size the Trainer really ran with."""

    def __init__(self, proc, out: Path):
        self.returncode, self.stdout, self.stderr, self.out = proc.returncode, proc.stdout, proc.stderr, out

    @property
    def world_size(self) -> int:
        """From the last checkpoint: the Trainer saves ``rng_state.pth`` alone, ``rng_state_<rank>.pth`` per rank."""
        ckpts = sorted(self.out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
        assert ckpts, f"no checkpoint-* in {self.out}: the world size cannot be read"
        per_rank = list(ckpts[-1].glob("rng_state_*.pth"))
        return len(per_rank) if per_rank else int((ckpts[-1] / "rng_state.pth").is_file())


@pytest.fixture()
def accelerate_cpu_launch(repo_root):
    """``launch(script, *args, out=DIR)`` runs a recipe under ``accelerate launch`` with 2 real CPU processes (gloo).

    ``accelerate launch --cpu --num_processes 2`` starts ONE process unless mpirun and a hostfile are set up
    (accelerate's simple launcher), so this uses accelerate's torchrun launcher (``--multi_gpu``): it starts
    the processes and sets RANK/WORLD_SIZE; the recipe configs' ``use_cpu: true`` then makes accelerate pick
    MULTI_CPU with the gloo backend. The README's scale-out section shows the same command.
    """
    import subprocess
    import sys

    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")

    def launch(script: str, *args: str, out: Path, num_processes: int = 2, timeout: float = 600) -> Launch:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", str(num_processes), "--num_machines", "1",
               "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no",
               script, *map(str, args), "--output_dir", str(out)]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=repo_root, env=env,
                              timeout=timeout)
        return Launch(proc, Path(out))

    return launch


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """A test that sets torch's thread count must not leak it: vLLM's CPU attention checks that the thread
    count its metadata was built with is the one it runs with, and fails later tests otherwise."""
    import torch

    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


_NO_NETWORK_SITE = '''
import socket

_connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex


def _refuse_remote(sock, address):
    if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
        raise OSError(f"no network in this test: connect to {address!r}")


def connect(self, address):
    _refuse_remote(self, address)
    return _connect(self, address)


def connect_ex(self, address):
    _refuse_remote(self, address)
    return _connect_ex(self, address)


socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
'''


@pytest.fixture(scope="session")
def offline_env(tmp_path_factory) -> dict:
    """Environment for a subprocess that meets llmkit as a user without network would: a ``sitecustomize`` on
    PYTHONPATH refuses every connection not to this machine ("no network in this test"), the Hugging Face
    offline switches are on, and no workspace data (LLMKIT_IHEVAL) is named. Prepend to PYTHONPATH as needed."""
    site = tmp_path_factory.mktemp("no_network")
    (site / "sitecustomize.py").write_text(_NO_NETWORK_SITE)
    env = {k: v for k, v in os.environ.items() if k not in ("LLMKIT_IHEVAL", "PYTHONPATH")}
    env.update(PYTHONPATH=str(site), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """One vLLM engine (bundled model, eager, float32, a random LoRA adapter served as "rnd") behind ``llmkit
    serve`` on loopback for every test that needs one: ``.url``, ``.http`` (httpx), ``.engine``."""
    import httpx
    import torch
    from peft import LoraConfig, get_peft_model

    from llmkit.engines.vllm import VLLMEngine
    from llmkit.models import load
    from llmkit.serving.server import BackgroundServer, ServerConfig, build_app

    adapter = tmp_path_factory.mktemp("lora") / "rnd"
    model, _ = load("smollm2-135m-instruct")
    torch.manual_seed(0)
    get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                     init_lora_weights=False)).save_pretrained(adapter)
    del model
    # float32: the engine test compares its greedy text with the hf engine's, which bf16 rounding can flip
    engine = VLLMEngine(None, enforce_eager=True, dtype="float32", lora_modules={"rnd": str(adapter)})
    try:
        with BackgroundServer(build_app(engine, ServerConfig(model_name="smollm2-135m-instruct"))) as server, \
                httpx.Client(base_url=server.url, timeout=300) as http:
            server.engine, server.http = engine, http
            yield server
    finally:
        engine.close()


def pytest_collection_modifyitems(config, items):
    """With ``pytest -n 2 --dist loadgroup`` (``make test``): a test file runs on one worker, so its module
    fixtures (models, engines, servers) are built once, and every test that uses the session's vLLM server
    runs on the same worker, so that engine starts once."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        group = "vllm_server" if "vllm_server" in getattr(item, "fixturenames", ()) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
