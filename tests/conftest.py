"""Shared fixtures: tiny in-process models, an offline tokenizer, a GSM8K slice; no network ever."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
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


def _write_gsm8k_slice(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_SLICE))
    return path


@pytest.fixture()
def gsm8k_slice(tmp_path) -> Path:
    """A 4-problem GSM8K file in the original JSONL format."""
    return _write_gsm8k_slice(tmp_path / "gsm8k_slice.jsonl")


# when this test process started: a file written after it was written by this run (any xdist worker's)
_SESSION_STARTED = __import__("time").time()


@pytest.fixture(scope="session")
def session_started() -> float:
    """``time.time()`` when this pytest process imported conftest (xdist workers start within seconds)."""
    return _SESSION_STARTED


@pytest.fixture(scope="session")
def bundled():
    """The real bundled model (smollm2-135m-instruct), loaded once per session. Mark users @pytest.mark.bundled."""
    from llmkit.models import load

    return load("smollm2-135m-instruct")


class Launch:
    """One job of the ``accelerate launch`` batch: exit code, output, and the world size the Trainer really ran
    with. ``returncode`` is 0 only if every rank finished the job with status 0; ``stdout``/``stderr`` are the
    ranks' output, rank 0 first."""

    def __init__(self, returncode: int, stdout: str, stderr: str, out: Path):
        self.returncode, self.stdout, self.stderr, self.out = returncode, stdout, stderr, out

    @property
    def world_size(self) -> int:
        """From the last checkpoint: the Trainer saves ``rng_state.pth`` alone, ``rng_state_<rank>.pth`` per rank."""
        ckpts = sorted(self.out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
        assert ckpts, f"no checkpoint-* in {self.out}: the world size cannot be read"
        per_rank = list(ckpts[-1].glob("rng_state_*.pth"))
        return len(per_rank) if per_rank else int((ckpts[-1] / "rng_state.pth").is_file())


# Every script the suite runs under `accelerate launch` with 2 CPU processes: name -> (script, args, timeout s).
# "{slice}" is a 4-problem GSM8K file, "{noisy}" the same questions with the answers shuffled; each job gets
# --output_dir <its own fresh folder>. A test names its job with @pytest.mark.accelerate_job(NAME).
ACCELERATE_JOBS = {
    "vspo": ("recipes/vspo.py", ["--config", "recipes/configs/vspo/tiny_cpu.yaml", "--dataset_name", "{slice}",
                                 "--eval_path", "{slice}", "--eval_num_problems", "2"], 600),
    "lqzo": ("recipes/lqzo.py", ["--config", "recipes/configs/lqzo/tiny_cpu.yaml", "--dataset_name", "{slice}",
                                 "--eval_data", "{slice}", "--max_eval_samples", "2", "--accuracy_samples", "4"],
             600),
    "smith": ("recipes/smith.py", ["--config", "recipes/configs/smith/tiny_cpu.yaml", "--eval_n", "1",
                                   "--eval_before", "true", "--eval_max_new_tokens", "8"], 600),
    "smith_split_prompts": ("recipes/smith.py", ["--config", "recipes/configs/smith/tiny_cpu.yaml",
                                                 "--per_device_train_batch_size", "3", "--save_strategy", "no"], 600),
    "halo": ("recipes/halo.py", ["--config", "recipes/configs/halo/tiny_cpu.yaml", "--dataset_name", "{slice}",
                                 "--forget_data", "{slice}", "--per_device_train_batch_size", "1"], 300),
    "halo_clip": ("tests/train/halo/clip_worker.py", [], 300),
    "hgms": ("recipes/hgms.py", ["--config", "recipes/configs/hgms/tiny_cpu.yaml", "--sources", "gsm8k={slice}",
                                 "noisy={noisy}", "--target_data", "{slice}", "--per_device_train_batch_size", "1"],
             600),
}
ACCELERATE_SLACK_S = 180  # the launcher's start and the barriers, beside the jobs' own time


def _accelerate_jobs_requested(session) -> list[str]:
    """The jobs of the collected tests that will run (``-k``, ``-m`` and a boolean ``skipif`` respected), so
    that running one of these tests alone launches its job only."""
    names = []
    for item in session.items:
        marker = item.get_closest_marker("accelerate_job")
        if marker is None or item.get_closest_marker("skip"):
            continue
        if any(m.args and m.args[0] is True for m in item.iter_markers("skipif")):
            continue
        if marker.args[0] not in names:
            names.append(marker.args[0])
    return names


class AccelerateBatch:
    """The results of one ``accelerate launch`` that ran several jobs; ``batch[name]`` is that job's Launch."""

    def __init__(self, jobs: list[dict], world: int, launcher_rc: int | None, launcher_log: str, timeout: float):
        self.jobs, self.world, self.launcher_rc, self.launcher_log, self.timeout = \
            jobs, world, launcher_rc, launcher_log, timeout

    def _statuses(self, job: dict) -> list[dict | None]:
        files = [Path(job["log_dir"]) / f"rank{r}.json" for r in range(self.world)]
        return [json.loads(f.read_text()) if f.is_file() else None for f in files]

    def _logs(self, job: dict, ext: str) -> str:
        files = [Path(job["log_dir"]) / f"rank{r}.{ext}" for r in range(self.world)]
        return "".join(f.read_text(errors="replace") for f in files if f.is_file())

    def __getitem__(self, name: str) -> Launch:
        job = next((j for j in self.jobs if j["name"] == name), None)
        if job is None:
            pytest.fail(f"accelerate job {name!r} was not in this session's batch")
        statuses = self._statuses(job)
        if all(statuses):
            rc = next((s["status"] for s in statuses if s["status"] != 0), 0)
            return Launch(rc, self._logs(job, "out"), self._logs(job, "err"), Path(job["out"]))
        how = (f"the batch timed out after {self.timeout:.0f} s" if self.launcher_rc is None
               else f"the launcher exited with {self.launcher_rc}")
        if Path(job["log_dir"]).is_dir():
            pytest.fail(f"accelerate job {name!r} did not finish on every rank (statuses {statuses}): it hung or "
                        f"crashed and {how}.\n--- its stderr ---\n{self._logs(job, 'err')[-3000:]}"
                        f"\n--- launcher ---\n{self.launcher_log[-2000:]}", pytrace=False)
        started = [j["name"] for j in self.jobs if Path(j["log_dir"]).is_dir()]
        pytest.fail(f"accelerate job {name!r} never ran: the batch stopped in job "
                    f"{started[-1] if started else None!r} ({how})", pytrace=False)


@pytest.fixture(scope="session")
def accelerate_batch(request, repo_root, tmp_path_factory) -> AccelerateBatch:
    """``accelerate_batch[name]``: the Launch of a job of ACCELERATE_JOBS, run under ONE ``accelerate launch``
    with 2 real CPU processes (gloo) that runs every requested job in turn (tests/accelerate_jobs.py).

    ``accelerate launch --cpu --num_processes 2`` starts ONE process unless mpirun and a hostfile are set up
    (accelerate's simple launcher), so this uses accelerate's torchrun launcher (``--multi_gpu``): it starts
    the processes and sets RANK/WORLD_SIZE; the recipe configs' ``use_cpu: true`` then makes accelerate pick
    MULTI_CPU with the gloo backend. The README's scale-out section shows the same command.

    Why one launch checks what one launch per job did: every job is still its script run as ``__main__`` with
    its own argv, under accelerate's launcher, in two real ranks that talk over the same gloo process group a
    fresh launch would create, each job into a fresh output folder; only the launcher's start and the imports of
    torch/transformers/trl are shared. What could leak between jobs, and what the driver does about it before
    each job: os.environ, cwd, sys.path, sys.stdout/err, torch's thread count, default dtype and global seed,
    transformers' log level and Python's warning filters are put back to the process's start; accelerate's
    AcceleratorState/PartialState/GradientState singletons are reset (transformers' TrainingArguments resets
    the first two itself too), the process group is kept (PartialState reuses it; nothing in llmkit ends it).
    Left shared, as in any long-lived process: imported modules and their caches (lru caches of pure
    functions in llmkit.tools), the once-per-process registries of libraries, atexit handlers.

    A job that hangs (a rank stuck in a collective) is ended by its own timeout (the driver dumps the stacks
    into the job's stderr and stops the batch); the whole launch also has a timeout. The test of the job that
    stopped the batch fails naming it, and so do the tests of the jobs that never ran.
    """
    import signal
    import subprocess
    import sys

    from llmkit.train.common import load_records
    from llmkit.train.hgms.mixtures import shuffled_answers, write_jsonl

    names = _accelerate_jobs_requested(request.session) or list(ACCELERATE_JOBS)
    base = tmp_path_factory.mktemp("accelerate")
    data = base / "data"
    data.mkdir()
    fill = {"{slice}": str(_write_gsm8k_slice(data / "gsm8k_slice.jsonl"))}
    fill["{noisy}"] = str(write_jsonl(shuffled_answers(load_records(fill["{slice}"]), seed=0), data / "noisy.jsonl"))

    def expand(arg: str) -> str:
        for key, value in fill.items():
            arg = arg.replace(key, value)
        return arg

    jobs = []
    for name in names:
        script, args, timeout = ACCELERATE_JOBS[name]
        out = base / name / "out"
        jobs.append({"name": name, "script": script, "argv": [*map(expand, args), "--output_dir", str(out)],
                     "out": str(out), "log_dir": str(base / name / "logs"), "timeout": timeout})
    (base / "jobs.json").write_text(json.dumps(jobs, indent=1))

    world = 2
    # accelerate's own launch module, which `accelerate launch` calls: the `accelerate` console script imports
    # every subcommand first (`estimate-memory` pulls in transformers' model code): 13 s against 4 s here
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(world), "--num_machines", "1",
           "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(repo_root / "tests" / "accelerate_jobs.py"), str(base / "jobs.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    timeout = sum(j["timeout"] for j in jobs) + ACCELERATE_SLACK_S
    log = base / "launcher.log"
    with open(log, "w") as f:
        # its own session, so that on a timeout the launcher and its workers are ended together
        proc = subprocess.Popen(cmd, cwd=repo_root, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            os.killpg(proc.pid, signal.SIGTERM)  # torchrun ends its workers on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return AccelerateBatch(jobs, world, rc, log.read_text(errors="replace"), timeout)


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


def pytest_configure(config):
    config.addinivalue_line("markers", "accelerate_job(name): the test reads job NAME of the accelerate_batch "
                                       "fixture (ACCELERATE_JOBS in tests/conftest.py)")


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook, which reads xdist_group into the node ids
def pytest_collection_modifyitems(config, items):
    """With ``pytest -n 2 --dist loadgroup`` (``make test``): a file whose tests share a module fixture
    (models, engines, servers) runs on one worker, so the fixture is built once; every test that uses the
    session's vLLM server runs on the same worker, so that engine starts once, and so does every test of the
    accelerate batch, so that it launches once (the first of those pays for the whole batch: its time limit
    covers the batch's). Every other test goes to whichever worker is free, which keeps the two workers busy
    to the end instead of waiting on the longest file."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "accelerate_batch" in fixtures and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(sum(t for *_, t in ACCELERATE_JOBS.values()) + 2 * ACCELERATE_SLACK_S))
        if item.get_closest_marker("xdist_group"):
            continue
        if "vllm_server" in fixtures:
            group = "vllm_server"
        elif "accelerate_batch" in fixtures:
            group = "accelerate"
        elif _uses_module_fixture(item):
            group = item.nodeid.split("::")[0]
        else:
            continue
        item.add_marker(pytest.mark.xdist_group(group))


def _uses_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope in ("module", "class", "package") for chain in defs for d in chain)

# ----------------------------------------------------------------------------- sandboxed kernel verifier runs
# One pool of sandboxed verifier runs, shared by the kernel tests and the doctor's kernels check. Each ``verify``
# starts its own sandboxed process (a fresh torch + triton import, then Triton's interpreter); that isolation is
# what the tests check, so it is kept. What is shared: the pool (three runs at a time, the same for every file,
# so one file's runs never stack on another's), and a run asked for twice with the same arguments (the good
# softmax, which three files verify; the zero-output kernel, which two do), which runs once. The tests that use
# it are one xdist group (``kernel_verifier``), so under ``make test`` they share one worker and these runs.
# On CPU they pass ``timing=False``: without a GPU, timing only adds a note, and the same arguments share a run.


class VerifyRuns:
    """``submit(ref, candidate, arch, precision, **verify_kwargs)``: a Future of ``verify``'s result, run once
    per distinct set of arguments."""

    def __init__(self, pool: ThreadPoolExecutor):
        # the real verify, kept here: a test may put this object in its place
        from llmkit.kernels.workbench.verify import verify

        self._verify, self._pool, self._lock, self._runs = verify, pool, threading.Lock(), {}

    def submit(self, ref: Path, candidate: Path, arch: str, precision: str, **kwargs) -> Future:
        key = (str(ref), str(candidate), arch, precision, tuple(sorted(kwargs.items())))
        with self._lock:
            if key not in self._runs:
                self._runs[key] = self._pool.submit(self._verify, ref, candidate, arch, precision, **kwargs)
            return self._runs[key]

    def __call__(self, *args, **kwargs) -> dict:
        return self.submit(*args, **kwargs).result()


@pytest.fixture(scope="session")
def verify_runs():
    with ThreadPoolExecutor(max_workers=3) as pool:
        yield VerifyRuns(pool)
