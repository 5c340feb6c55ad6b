"""``llmkit train smith``: SMITH, one policy trained to build tools and to use them, with three reward axes.

Paper: "SMITH: Schema-grounded Multi-task Iterative Tool Honing" (NeurIPS 2026).
Tool-creation systems prompt a frozen model, so the writer never learns whether it can invoke what it wrote.
SMITH trains creation and use in one policy with RL:

1. each rollout is a **build** task (K input/output examples of a procedural family -> a tool: JSON Schema +
   Python function) or a **use** task (a question + a pooled tool's schema -> a tool call and an answer);
2. build code runs in a sandbox (``llmkit.tools.sandbox``: bubblewrap, no network, rlimits) on fresh instances;
   tools that pass join the pool that later use tasks draw from;
3. three reward functions score **schema** (valid JSON Schema matching the function's signature; for use, the
   call validates), **code** (runs within limits, returns the declared type) and **outcome** (exact verifier),
   each ``None`` where it does not apply; GRPO normalizes each axis in its group before the weighted sum
   (``normalize_then_sum``), so each failure mode has its own gradient.

Where this code deviates, and why:
* Rollouts are single-turn. A use reply holds the call and an ``Answer:`` line; the call's value is the answer (the
  policy does not see the tool's result in a second turn). It keeps one generation per row, which is what GRPO on
  CPU can afford; the outcome axis still checks the pooled tool end to end.
* The pool grows inside the trainer (TRL fixes ``tools=`` at start), see ``SmithTrainer``.
* An empty pool is seeded before GRPO (``seed_pool``; default: the training families' reference tools, which are
  what the warm start teaches, verified in the sandbox like any build; ``policy``: the starting policy's own
  verified builds), and ``use_share`` of every step's prompts are use tasks. Without a seed, a policy that builds
  nothing verified never sees a use task, and the "one policy that builds and uses" is never trained on use.
* 13 families: ten from reasoning-gym (exact verifiers of our own), two of our own, nine for training and four
  held out; the paper's families are not public.
* ``warm_start_steps`` > 0 first fine-tunes (SFT, TRL's ``SFTTrainer``) on the reference tools' traces of the
  TRAINING families only (``warm_start_use_share`` use traces: the exact ``<tool_call>`` JSON the parser reads
  plus the answer; the rest build traces: spec + code); a model as small as the bundled 135M one otherwise never
  writes a parseable tool or call, and RL has no signal. Off by default; the bench says when it is used.
* The "combined" aggregation (one scalar reward = schema + code + outcome) is the paper's ablation.

Outputs in ``output_dir``: ``resolved_config.yaml`` (and ``.json``); ``pool/`` (the seeded tools and the tools the policy built, with provenance);
``checkpoint-*/`` (rerunning the same command resumes from the last one; the pool on disk carries over);
the final model; ``metrics.jsonl`` (``rewards/schema_reward/mean``, ``rewards/code_reward/mean``,
``rewards/outcome_reward/mean``, ``smith/pool_size`` ...); ``reward_curves.png``; ``eval.json`` (held-out
macro accuracy: the trained writer's tools used by the policy, and no tools).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from trl import ModelConfig

from llmkit.train.smith.config import SmithConfig

CONFIG_CLASSES = (SmithConfig, ModelConfig)
AXES = ("schema_reward", "code_reward", "outcome_reward")


def reward_functions(cfg: SmithConfig, pool):
    """(reward funcs, SmithRewards): the three axes, or the single combined scalar for the ablation."""
    from llmkit.rewards.tools import SmithRewards
    from llmkit.tools.sandbox import Limits

    def add(spec, family, score, step):
        spec.meta["family"] = family
        pool.add(spec, family, score, step=step, source="policy")

    r = SmithRewards(checks=cfg.build_checks, pass_threshold=cfg.pass_threshold, on_pass=add,
                     limits=Limits(timeout=cfg.sandbox_timeout, memory_mb=cfg.sandbox_memory_mb),
                     unsafe=cfg.unsafe_no_sandbox)
    if cfg.reward_aggregation != "combined":
        return r.funcs, r

    def combined_reward(completions=None, **kw):
        parts = [f(completions=completions, **kw) for f in r.funcs]
        return [None if all(p[i] is None for p in parts) else
                cfg.schema_weight * (parts[0][i] or 0.0) + cfg.code_weight * (parts[1][i] or 0.0)
                + cfg.outcome_weight * (parts[2][i] or 0.0) for i in range(len(parts[0]))]

    return [combined_reward], r


def seed_pool(cfg: SmithConfig, pool, families, model=None, tok=None) -> dict:
    """Fill an EMPTY pool before GRPO as ``cfg.seed_pool`` says, so use tasks train from the first step; returns
    ``{family: joined}`` ({} when the pool already had tools or seeding is off). Each candidate goes through the
    same verification as any build (``build_tools``: sandboxed, ``build_checks`` fresh instances,
    ``pass_threshold``)."""
    from llmkit.tools import tasks
    from llmkit.tools.evaluate import build_tools, local_generator
    from llmkit.tools.rollouts import reference_build_trace
    from llmkit.tools.sandbox import Limits

    if cfg.seed_pool == "none" or len(pool):
        return {}
    families = [f for f in families if f not in tasks.HELDOUT_FAMILIES]
    if cfg.seed_pool == "reference":
        def gen(convs):  # build_tools asks once per family, in order
            return [reference_build_trace(tasks.get(f)) for f in families]
        source = "warm_start"
    else:
        gen = local_generator(ready_for_generation(model), tok, max_new_tokens=cfg.eval_build_max_new_tokens,
                              batch_size=16)
        source = "seed"
    report = build_tools(gen, families, pool, examples=cfg.build_examples, checks=cfg.build_checks,
                         min_score=cfg.pass_threshold, source=source, step=-1, seed=cfg.seed,
                         limits=Limits(timeout=cfg.sandbox_timeout, memory_mb=cfg.sandbox_memory_mb),
                         unsafe=cfg.unsafe_no_sandbox, progress=False)
    return {f: r["added"] for f, r in report.items()}


def warm_start_rows(cfg: SmithConfig, families, n: int) -> list[dict]:
    """``n`` SFT rows (prompt/completion) from the reference tools of ``families``: a ``warm_start_use_share`` of
    them use traces (the use prompt with the reference tool's schema -> the exact ``<tool_call>`` JSON and the
    answer), the rest build traces (the build prompt -> the reference spec + code). Families cycle; held-out
    families are refused."""
    from llmkit.tools import tasks
    from llmkit.tools.rollouts import build_prompt, reference_build_trace, reference_use_trace, use_prompt

    leaked = set(families) & set(tasks.HELDOUT_FAMILIES)
    if leaked:
        raise ValueError(f"warm start on held-out families {sorted(leaked)} refused; they must stay unseen")
    rows, n_use = [], 0
    for i in range(n):
        seed = 10_000 + i  # training seeds (< EVAL_SEED_OFFSET): never an evaluation or check instance
        if n_use < round(cfg.warm_start_use_share * (i + 1)):  # spread the use traces evenly
            fam = tasks.get(families[n_use % len(families)])  # each kind cycles the families on its own
            n_use += 1
            inst = fam.generate(1, seed=seed)[0]
            rows.append({"prompt": use_prompt(inst, fam.reference),
                         "completion": [{"role": "assistant", "content": reference_use_trace(inst, fam.reference)}]})
        else:
            fam = tasks.get(families[(i - n_use) % len(families)])
            rows.append({"prompt": build_prompt(fam, fam.generate(cfg.build_examples, seed=seed)),
                         "completion": [{"role": "assistant", "content": reference_build_trace(fam)}]})
    return rows


def warm_start(cfg: SmithConfig, model, tok, families, out: Path):
    """A short SFT (TRL's ``SFTTrainer``, loss on the completion only) on :func:`warm_start_rows` of the training
    families."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rows = warm_start_rows(cfg, list(families),
                           max(cfg.warm_start_steps * cfg.per_device_train_batch_size, len(families)))
    frozen = freeze_below_top_layers(model, cfg.warm_start_top_layers)
    args = SFTConfig(output_dir=str(out / "warm_start"), max_steps=cfg.warm_start_steps,
                     per_device_train_batch_size=cfg.per_device_train_batch_size, learning_rate=cfg.warm_start_lr,
                     logging_steps=max(1, cfg.warm_start_steps // 5), save_strategy="no", report_to="none",
                     use_cpu=cfg.use_cpu, bf16=cfg.bf16, seed=cfg.seed, max_length=1024)
    SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok).train()
    for p in frozen:
        p.requires_grad_(True)
    return model


def freeze_below_top_layers(model, top: int) -> list:
    """Set ``requires_grad=False`` on every parameter except those of the top ``top`` decoder layers, the final norm
    and the output head (tied input embeddings stay trainable through the head); returns what was frozen. ``top``
    <= 0 freezes nothing."""
    if top <= 0:
        return []
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("warm_start_top_layers needs a decoder with model.layers (a Llama-style causal LM)")
    keep = {id(p) for layer in list(layers)[-top:] for p in layer.parameters()}
    keep |= {id(p) for p in model.get_output_embeddings().parameters()}
    norm = getattr(model.model, "norm", None)
    if norm is not None:
        keep |= {id(p) for p in norm.parameters()}
    frozen = [p for p in model.parameters() if p.requires_grad and id(p) not in keep]
    for p in frozen:
        p.requires_grad_(False)
    return frozen


def ready_for_generation(model):
    """Eval mode and no gradient checkpointing. The trainer leaves the model in train mode with checkpointing on,
    which turns the KV cache off: the cached decoding of ``llmkit.generation`` then sees one new token at a time
    without its context and writes garbage (the first bundled-model runs evaluated "<-----..." replies)."""
    if getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()
    model.eval()
    return model


def evaluate_policy(model, tok, cfg: SmithConfig, out: Path, tag: str) -> dict:
    """The policy writes a tool per evaluated family (into ``<out>/eval_pool_<tag>``) and answers held-out questions
    with it; also without tools. Families are never built from the evaluation questions."""
    from llmkit.tools import tasks
    from llmkit.tools.evaluate import build_tools, evaluate, local_generator
    from llmkit.tools.pool import ToolPool
    from llmkit.tools.sandbox import Limits

    ready_for_generation(model)
    fams = tasks.names(cfg.eval_families)
    gen = local_generator(model, tok, max_new_tokens=cfg.eval_max_new_tokens, batch_size=16)
    build_gen = local_generator(model, tok, max_new_tokens=cfg.eval_build_max_new_tokens, batch_size=16)
    limits = Limits(timeout=cfg.sandbox_timeout, memory_mb=cfg.sandbox_memory_mb)
    pool = ToolPool(out / f"eval_pool_{tag}")
    built = build_tools(build_gen, fams, pool, examples=cfg.build_examples, checks=cfg.build_checks,
                        min_score=cfg.pass_threshold, source=f"policy-{tag}", limits=limits,
                        unsafe=cfg.unsafe_no_sandbox)
    with_tools = evaluate(gen, fams, pool=pool, n=cfg.eval_n, limits=limits, unsafe=cfg.unsafe_no_sandbox)
    no_tools = evaluate(gen, fams, mode="none", n=cfg.eval_n) if cfg.eval_no_tools else None
    reference = (evaluate(gen, fams, mode="reference", n=cfg.eval_n, limits=limits, unsafe=cfg.unsafe_no_sandbox)
                 if cfg.eval_reference else None)
    print(f"eval {tag}: held-out macro with own tools {with_tools['macro']:.3f}"
          + (f", with the reference tools {reference['macro']:.3f} (call parse rate "
             f"{reference['call_parse_rate']:.2f})" if reference else "")
          + (f", without tools {no_tools['macro']:.3f}" if no_tools else "")
          + f", tools built {sum(b['added'] for b in built.values())}/{len(fams)}")
    return {"with_tools": with_tools, "no_tools": no_tools, "reference_tools": reference,
            "use_call_parse_rate": reference["call_parse_rate"] if reference else None,
            "built": {k: {a: v[a] for a in ("schema", "code", "outcome", "added")} for k, v in built.items()}}


def main(cfg: SmithConfig, model_args: ModelConfig | None = None) -> int:
    from datasets import Dataset
    from trl import get_peft_config

    from llmkit.models import load_for_training
    from llmkit.tools import sandbox, tasks
    from llmkit.tools.pool import ToolPool
    from llmkit.train.common import wait_for_everyone
    from llmkit.train.skeleton import RecipeRun
    from llmkit.train.smith.trainer import SmithTrainer, make_rows

    model_args = model_args or ModelConfig()
    out = Path(cfg.output_dir)
    # under `accelerate launch` every rank trains (and its rollouts add to the shared pool folder); the side
    # work (config, evaluations, plot, eval.json) runs on the main process only
    out.mkdir(parents=True, exist_ok=True)
    ok, why = sandbox.check_available()
    if not ok and not cfg.unsafe_no_sandbox:
        raise ValueError(f"{why}. SMITH runs model-written code; refusing to run it unconfined. Set "
                         "unsafe_no_sandbox: true to run it without isolation at your own risk.")
    families = tasks.names(cfg.train_families)
    leaked = set(families) & set(tasks.HELDOUT_FAMILIES)
    if leaked:
        raise ValueError(f"train_families includes held-out families {sorted(leaked)}; they must stay unseen")
    run = RecipeRun("smith", cfg, cfg, model_args)
    is_main, resume = run.is_main, run.resume
    if run.config_path:
        print(f"saved {run.config_path}")
    model, tok = load_for_training(model_args, output_dir=out, seed=cfg.tiny_model_seed, is_main=is_main)
    pool = ToolPool(cfg.pool_dir or out / "pool")
    results: dict = {"model": str(model_args.model_name_or_path), "reward_aggregation": cfg.reward_aggregation,
                     "warm_start_steps": cfg.warm_start_steps}
    eval_json = out / "eval.json"
    if resume and eval_json.is_file():
        results.update({k: v for k, v in json.loads(eval_json.read_text()).items() if k in ("before",)})
    if cfg.eval_before and cfg.eval_n > 0 and not resume and is_main:
        results["before"] = evaluate_policy(model, tok, cfg, out, "before")
    if cfg.warm_start_steps > 0 and not resume:
        t0 = time.time()
        model = warm_start(cfg, model, tok, families, out)
        results["warm_start_seconds"] = round(time.time() - t0, 1)
    if is_main:
        seeded = seed_pool(cfg, pool, families, model, tok)
        if seeded:
            results["seeded_pool"] = {"from": cfg.seed_pool, "families": seeded}
            print(f"seeded the empty pool ({cfg.seed_pool}): {sum(seeded.values())}/{len(seeded)} training "
                  "families verified")
    wait_for_everyone()  # every rank starts GRPO with the seeded pool
    funcs, _ = reward_functions(cfg, pool)
    rows = make_rows(families, cfg.num_prompts, cfg.build_examples, seed=cfg.seed)
    trainer = SmithTrainer(model=model, args=cfg, reward_funcs=funcs, train_dataset=Dataset.from_list(rows),
                           processing_class=tok, peft_config=get_peft_config(model_args), pool=pool,
                           build_examples=cfg.build_examples, use_share=cfg.use_share,
                           callbacks=run.callbacks())
    run.train(trainer)
    results["train_seconds"] = round(run.train_seconds, 1)
    results["steps"] = trainer.state.global_step
    # the share of use rollouts in each logged GRPO step (the check that both skills train every step)
    results["use_fraction"] = [r["smith/use_fraction"] for r in trainer.state.log_history
                               if "smith/use_fraction" in r]
    trainer.save_model(str(out))
    wait_for_everyone()  # every rank's builds are in the pool folder before the main process reads it
    if not is_main:
        return 0
    results["world_size"] = cfg.world_size
    results["pool_size"] = len(pool)
    results["pool_growth"] = pool.growth()
    results["pool"] = [{"family": e.family, "name": e.spec.name, "score": e.score, "step": e.step}
                       for e in pool.entries()]
    if cfg.eval_n > 0:
        model = trainer.accelerator.unwrap_model(trainer.model)
        results["after"] = evaluate_policy(model, tok, cfg, out, "after")
    png = run.plot_rewards(f"SMITH ({cfg.reward_aggregation})", ("smith/pool_size",), ylabel="reward / pool size")
    if png:
        print(f"reward curves: {png}")
    run.write_results(eval_json.name, results)
    print(f"pool: {len(pool)} tool(s) in {pool.path}; results: {eval_json}")
    return 0
