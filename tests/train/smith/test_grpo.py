"""One SMITH GRPO step through TRL with a pre-seeded pool: use rows are generated, rewarded with the pooled tool
attached, and reach the loss with non-zero advantages. Generation is scripted (the tiny random model writes no
call), everything after it is TRL's and SMITH's own code."""

from __future__ import annotations

import json

import pytest

from llmkit.tools import ToolPool, ToolSpec, sandbox, tasks
from llmkit.tools.rollouts import reference_use_trace

needs_sandbox = pytest.mark.skipif(not sandbox.check_available()[0], reason="bubblewrap cannot run here")
FAMILIES = ["gcd", "digit_sum"]


@pytest.mark.slow  # ~25 s on the shared 2-core CPU (TRL start, four sandbox runs)
@needs_sandbox
def test_one_grpo_step_trains_use_rows_with_the_pooled_tool(tmp_path, tiny_model, tiny_tokenizer):
    from datasets import Dataset

    from llmkit.train.smith.config import SmithConfig
    from llmkit.train.smith.recipe import reward_functions, seed_pool
    from llmkit.train.smith.trainer import SmithTrainer, make_rows

    cfg = SmithConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_steps=1,
                      per_device_train_batch_size=8, num_generations=2, max_completion_length=128,
                      learning_rate=1e-3, beta=0.0, logging_steps=1, save_strategy="no", use_share=0.5,
                      build_examples=2, build_checks=2, dataloader_num_workers=0, seed=0)
    pool = ToolPool(tmp_path / "pool")
    assert seed_pool(cfg, pool, FAMILIES) == {"gcd": True, "digit_sum": True}
    funcs, _ = reward_functions(cfg, pool)
    scored = []

    def spy(f):
        def g(completions=None, **kw):
            out = f(completions=completions, **kw)
            scored.append((f.__name__, list(kw["kind"]), list(kw["tool"]), out))
            return out

        g.__name__ = f.__name__
        return g

    trainer = SmithTrainer(model=tiny_model, args=cfg, reward_funcs=[spy(f) for f in funcs],
                           train_dataset=Dataset.from_list(make_rows(FAMILIES, 8, examples=2)),
                           processing_class=tiny_tokenizer, pool=pool, build_examples=2, use_share=0.5)
    batches, loss_inputs = [], []
    resolve = trainer.resolve_batch
    trainer.resolve_batch = lambda inputs: batches.append(resolve(inputs)) or batches[-1]

    def scripted(prompt_ids, images, multimodal_fields, num_generations, **kw):
        """The first generation of every use prompt calls the pooled tool right; everything else is noise."""
        rows, out = batches[-1], []
        assert len(rows) == len(prompt_ids)
        for i, row in enumerate(rows):
            text = "no idea"
            if row["kind"] == "use" and i % num_generations == 0:
                d = json.loads(row["instance"])
                inst = tasks.Instance(row["family"], d["question"], d["args"], d["answer"])
                text = reference_use_trace(inst, ToolSpec.from_dict(json.loads(row["tool"])))
            out.append(tiny_tokenizer.encode(text, add_special_tokens=False) + [tiny_tokenizer.eos_token_id])
        return out, None

    trainer._generate_single_turn = scripted
    compute_loss = trainer.compute_loss

    def spy_loss(model, inputs, *a, **k):
        loss_inputs.append({n: inputs[n].detach().clone() for n in ("advantages", "completion_ids", "completion_mask")})
        return compute_loss(model, inputs, *a, **k)

    trainer.compute_loss = spy_loss
    trainer.train()

    # generated: half the step's prompts were use tasks on a seeded tool
    rows = batches[0]
    assert sum(r["kind"] == "use" for r in rows) == 4 and sum(r["kind"] == "build" for r in rows) == 4
    assert [r["smith/use_fraction"] for r in trainer.state.log_history if "smith/use_fraction" in r] == [0.5]
    # rewarded with the tool attached: every use row's reward call carried the pooled tool, and the right call
    # scored on all three axes
    pooled = {e.spec.name for e in pool.entries()}
    _, kinds, tools, schema = next(s for s in scored if s[0] == "schema_reward")
    use_idx = [i for i, k in enumerate(kinds) if k == "use"]
    assert len(use_idx) == 4 and all(json.loads(tools[i])["name"] in pooled for i in use_idx)
    outcome = next(s for s in scored if s[0] == "outcome_reward")[3]
    right = [i for i in use_idx if i % 2 == 0]
    assert all(schema[i] == 1.0 and outcome[i] == 1.0 for i in right)
    assert all(schema[i] == 0.0 for i in use_idx if i not in right)
    # contributed to the loss: the use completions are in the loss's batch, unmasked, with non-zero advantages
    # (right calls pushed up, the noise beside them down); the all-noise build groups carry none
    (batch,) = loss_inputs
    texts = [tiny_tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
             for ids, m in zip(batch["completion_ids"], batch["completion_mask"])]
    adv = batch["advantages"].view(-1).tolist()
    calls = [a for t, a in zip(texts, adv) if "<tool_call>" in t]
    assert len(calls) == 2 and all(a > 0.5 for a in calls)
    assert sum(a < -0.5 for t, a in zip(texts, adv) if "<tool_call>" not in t) == 2
    assert sum(abs(a) < 1e-3 for a in adv) == 4


@pytest.mark.slow  # two processes: a job of the one accelerate launch the suite shares (conftest)
@needs_sandbox
@pytest.mark.accelerate_job("smith_split_prompts")  # --per_device_train_batch_size 3 --save_strategy no
def test_two_ranks_agree_on_each_steps_use_prompts(accelerate_batch):
    """3 prompts a step over 2 ranks (3 rows each): the middle prompt's two generations sit on different ranks.
    The use share is counted over both ranks, and a prompt split across ranks gets the same kind on both: the
    step's use rows come in whole groups (4 of 6 rows at step 1, 2 of 6 at step 2)."""
    r = accelerate_batch["smith_split_prompts"]
    out = r.out
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "eval.json").read_text())
    assert res["world_size"] == 2 and res["steps"] == 2
    assert res["use_fraction"] == pytest.approx([4 / 6, 2 / 6])
    assert r.stdout.count("seeded the empty pool") == 1  # the main rank seeds; the other waits for it
