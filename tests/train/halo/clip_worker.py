"""One HALO step on a tiny model with clipping and gradient accumulation; writes the per-unit update norms.

Run in process by ``test_halo_clipping.py`` and, as a script, under ``accelerate launch`` with two CPU
processes (DDP over gloo), where frozen units always run backward.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MAX_GRAD_NORM = 1e-3  # far below the tiny model's gradient norm, so clipping always binds
LR = 1.0  # plain SGD: the active units' update is -LR * (clipped gradient), of norm LR * MAX_GRAD_NORM


def run(out_dir: str | Path, skip_frozen_backward: bool = True, grad_accum: int = 2) -> dict:
    import torch
    from trl import SFTConfig

    from llmkit.testing import tiny_llama, tiny_tokenizer
    from llmkit.train.common import chat_dataset
    from llmkit.train.halo.trainer import trainer_class

    rows = [{"question": f"What is {i} + {i + 3}?", "answer": f"{i} + {i + 3} = {2 * i + 3}. #### {2 * i + 3}"}
            for i in range(8)]
    tok, model = tiny_tokenizer(), tiny_llama(seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = SFTConfig(
        output_dir=str(out_dir), max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=grad_accum,
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM, max_length=64, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    # homotopy over the whole run: at step 0 only the output unit (LM head + final norm) updates
    trainer = trainer_class(distill=False)(
        model=model, args=args, train_dataset=chat_dataset(rows), processing_class=tok,
        halo_callback_kwargs={"method": "halo", "homotopy_fraction": 1.0, "ramp_width": 0.5,
                              "skip_frozen_backward": skip_frozen_backward})
    trainer.train()
    units = trainer.halo.controller.units
    names = {n for u in units[:1] for n in u.names}
    with torch.no_grad():
        active = sum(float((p - before[n]).pow(2).sum()) for n, p in model.named_parameters() if n in names) ** 0.5
        frozen = max(float((p - before[n]).abs().max()) for n, p in model.named_parameters() if n not in names)
    grad_norm = next((r["grad_norm"] for r in trainer.state.log_history if "grad_norm" in r), None)
    res = {"active_update_norm": active, "frozen_max_change": frozen, "logged_grad_norm": grad_norm,
           "world_size": trainer.args.world_size}
    if trainer.is_world_process_zero():
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "clip.json").write_text(json.dumps(res))
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--output_dir", required=True)
    run(ap.parse_args().output_dir)
