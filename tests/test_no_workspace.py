"""The library works outside this workspace: no ../shared paths, hub ids (or packaged files) as data defaults,
one loader for "hub id or local path", and the GSM8K sample that ships inside the package. No network: the
hub calls are replaced by fakes that record what they were asked for."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import llmkit
from llmkit.data import GSM8K_SAMPLE
from llmkit.evals.data import DataError, is_hub_id, load_source

PKG = Path(llmkit.__file__).resolve().parent


def test_no_workspace_path_or_seed_file_in_the_library():
    hits = []
    for p in sorted(PKG.rglob("*")):
        if p.suffix not in (".py", ".yaml", ".json", ".jinja", ".md", ".txt") or not p.is_file():
            continue
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            # ../shared/..., a seed abstract file name, or a path built as <repo>.parent / "shared"
            if "shared/" in line or re.search(r"\b00\d_[0-9a-f]{16}\.txt", line) or '/ "shared"' in line:
                hits.append(f"{p.relative_to(PKG.parent)}:{n}: {line.strip()[:100]}")
    assert not hits, "workspace paths in llmkit/:\n" + "\n".join(hits)


def test_papers_are_cited_by_venue():
    # every module that cites a seed paper names the venue instead of a file
    for rel in ("train/vspo/trainer.py", "serving/kv_cache/inquant.py", "optim/jd.py", "train/halo/__init__.py"):
        doc = (PKG / rel).read_text(encoding="utf-8").split('"""')[1]
        assert "NeurIPS 2026" in doc, rel


def test_data_defaults_are_hub_ids(monkeypatch):
    from llmkit.commands import kv, steer
    from llmkit.evals import iheval
    from llmkit.train.halo.config import HaloArguments
    from llmkit.train.lqzo.config import LQZOArguments
    from llmkit.train.vspo.config import VSPOConfig

    for args in (HaloArguments(), LQZOArguments()):
        assert (args.dataset_name, args.dataset_config) == ("openai/gsm8k", "main")
    # another dataset keeps no config unless asked for one
    assert HaloArguments(dataset_name="org/other").dataset_config is None
    vspo = VSPOConfig(output_dir="/tmp/x", use_cpu=True, report_to="none")
    assert (vspo.dataset_name, vspo.eval_path) == ("openai/gsm8k", "openai/gsm8k")
    assert kv.DEFAULT_DATA == steer.DEFAULT_QUESTIONS == "openai/gsm8k"
    monkeypatch.delenv("LLMKIT_IHEVAL", raising=False)
    assert iheval.default_root() == iheval.HUB_ID == "zhihz0535/IHEval"
    monkeypatch.setenv("LLMKIT_IHEVAL", "/some/benchmark")
    assert iheval.default_root() == "/some/benchmark"


def test_is_hub_id_tells_ids_from_paths(tmp_path, monkeypatch):
    assert is_hub_id("openai/gsm8k") and is_hub_id("HuggingFaceH4/MATH-500")
    for path in ("data/test.jsonl", "./a/b", "/abs/path", "notes.txt", "gsm8k", "a/b/c", "x/y.json"):
        assert not is_hub_id(path), path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "set").mkdir(parents=True)
    assert not is_hub_id("org/set")  # an existing local folder wins over the hub
    assert not is_hub_id(Path("openai/gsm8k"))  # a Path is always local


@pytest.fixture()
def fake_hub(monkeypatch):
    import datasets

    calls = []

    def load_dataset(hub_id, config=None, split=None, **kw):
        calls.append((hub_id, config, split))
        return [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(3)]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_load_source_reads_local_files_and_folders_and_sends_ids_to_the_hub(tmp_path, fake_hub):
    rows = load_source(GSM8K_SAMPLE)  # a folder: its test.jsonl
    assert len(rows) == 40 and rows[0]["_source"].endswith("test.jsonl:1")
    assert len(load_source(GSM8K_SAMPLE, split="train")) == 8
    assert len(load_source(str(GSM8K_SAMPLE / "test.jsonl"))) == 40
    assert fake_hub == []
    rows = load_source("openai/gsm8k", split="train", config="main")
    assert fake_hub == [("openai/gsm8k", "main", "train")] and rows[2]["_source"] == "openai/gsm8k:train:2"
    with pytest.raises(DataError, match="no such data file or folder: .*missing.jsonl"):
        load_source(str(tmp_path / "missing.jsonl"))


def test_eval_tasks_accept_a_hub_id_or_a_path_in_the_same_place(fake_hub):
    from llmkit.evals.tasks import get_task

    task = get_task("gsm8k")
    assert len(task.load(str(GSM8K_SAMPLE), limit=5)) == 5
    assert len(task.build_prompt(task.load(str(GSM8K_SAMPLE), 1)[0], num_fewshot=3)) == 7  # shots from train.jsonl
    assert fake_hub == []
    task.load(None, limit=2)
    assert fake_hub == [("openai/gsm8k", "main", "test")]
    get_task("gsm8k").load("someone/gsm8k-copy")  # another id: the task's own config does not apply
    assert fake_hub[-1] == ("someone/gsm8k-copy", None, "test")


def test_commands_read_hub_ids(tmp_path, fake_hub):
    from llmkit.commands import kv, steer
    from llmkit.serving.guard import injection

    assert steer._questions("openai/gsm8k", 2) == ["q0", "q1"]
    assert fake_hub[-1] == ("openai/gsm8k", "main", "train")
    assert steer._questions(str(GSM8K_SAMPLE / "train.jsonl"), 1)[0].startswith("Natalia")
    path = kv._local_data("openai/gsm8k", str(tmp_path))
    assert fake_hub[-1] == ("openai/gsm8k", "main", "train")
    assert [json.loads(x) for x in Path(path).read_text().splitlines()][1] == {"question": "q1", "answer": "#### 1"}
    assert kv._local_data("notes.txt", str(tmp_path)) == "notes.txt"
    assert injection.gsm8k_questions(limit=2) == ["q0", "q1"]
    assert fake_hub[-1] == ("openai/gsm8k", "main", "test")


def test_iheval_default_is_the_hub_copy_and_offline_says_what_to_do(tmp_path, monkeypatch):
    import huggingface_hub

    from llmkit.evals import iheval

    monkeypatch.delenv("LLMKIT_IHEVAL", raising=False)
    snap = tmp_path / "snap"
    task_dir = snap / "iheval" / "safety" / "user-prompt-hijack" / "aligned" / "default"
    task_dir.mkdir(parents=True)
    (task_dir / "input_data.json").write_text(json.dumps(
        [{"id": 1, "system": "s", "instruction": "hi", "answer": {"label": 0}}]))
    asked = []

    def snapshot_download(repo_id, repo_type=None, allow_patterns=None, **kw):
        asked.append((repo_id, repo_type))
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    iheval._hub_root.cache_clear()
    assert iheval.list_tasks() == [("safety", "user-prompt-hijack")]
    assert asked == [("zhihz0535/IHEval", "dataset")]
    assert iheval.load(tasks=["user-prompt-hijack"])[0]["instruction"] == "hi"

    def offline(*a, **kw):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    iheval._hub_root.cache_clear()
    with pytest.raises(DataError, match="could not fetch IHEval.*LLMKIT_IHEVAL"):
        iheval.list_tasks()
    with pytest.raises(DataError, match="folder not found: .*nope"):
        iheval.list_tasks(tmp_path / "nope")
    iheval._hub_root.cache_clear()


def test_the_packaged_gsm8k_sample_is_valid_and_licensed(repo_root):
    from llmkit.evals.tasks import get_task

    task = get_task("gsm8k")
    rows = task.load(str(GSM8K_SAMPLE))
    assert len(rows) == 40 and all(task.gold(r).replace(",", "").lstrip("-").isdigit() for r in rows)
    lic = (GSM8K_SAMPLE / "LICENSE").read_text()
    assert "MIT License" in lic and "Copyright (c) 2021 OpenAI" in lic
    pyproject = (repo_root / "pyproject.toml").read_text()
    assert '"data/gsm8k/*.jsonl"' in pyproject and '"data/gsm8k/LICENSE"' in pyproject


def test_offline_hub_error_points_at_data_and_the_packaged_sample(monkeypatch):
    import datasets

    from llmkit.evals.tasks import get_task

    def offline(*a, **kw):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="openai/gsm8k") as e:
        get_task("gsm8k").load(None, limit=2)
    assert "--data" in str(e.value) and str(GSM8K_SAMPLE) in str(e.value)
