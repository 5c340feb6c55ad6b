"""Teacher-forced capture of a response's hidden states (and token log-probs) in transformers.

A response is the last message of an OpenAI-style conversation. Its prompt is
the chat template applied to the earlier messages with the generation prompt,
exactly what an engine would have generated from; the response tokens follow.
One forward pass over prompt + response gives, for each chosen layer, the
states at the response positions (the "latent trajectory"), and, when asked,
the log-probability and predictive entropy of each response token (for the
perplexity baseline).

Layer ids index ``output_hidden_states``: 0 is the embedding output, ``l`` the
output of decoder block ``l`` (the last one has the final norm applied, as
transformers returns it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Capture:
    """What one response looks like inside the model."""

    states: dict[int, torch.Tensor]  # layer -> (T, d) float32, T = response tokens kept
    token_logprobs: torch.Tensor | None = None  # (T,) log p(token | prefix)
    token_entropies: torch.Tensor | None = None  # (T,) entropy of the predictive distribution
    n_tokens: int = 0
    extra: dict = field(default_factory=dict)


def split_conversation(messages: list[dict]) -> tuple[list[dict], str]:
    """(prompt messages, response text); the last message must be the assistant's response."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        raise ValueError("the last message must be the assistant's response (role 'assistant')")
    if len(messages) < 2:
        raise ValueError("'messages' needs at least one message before the assistant's response")
    return messages[:-1], str(last.get("content") or "")


def default_layers(num_layers: int, count: int = 4) -> list[int]:
    """``count`` evenly spaced blocks over the second half of the network, the last one included."""
    count = max(1, min(count, num_layers))
    start = num_layers / 2
    ids = sorted({max(1, round(start + (num_layers - start) * (i + 1) / count)) for i in range(count)})
    return ids


def _backbone(model):
    base = getattr(model, model.base_model_prefix, None)
    return base if base is not None else model


def _encode(tokenizer, prompt_messages, response, max_length, max_response_tokens):
    from llmkit.generation import chat_prompt

    p_ids = tokenizer(chat_prompt(tokenizer, prompt_messages), add_special_tokens=False)["input_ids"]
    r_ids = tokenizer(response, add_special_tokens=False)["input_ids"][:max_response_tokens]
    keep_prompt = max(1, max_length - len(r_ids))
    p_ids = p_ids[-keep_prompt:]  # keep the end of a long prompt: it is what the response reads last
    return p_ids, r_ids


@torch.inference_mode()
def capture(model, tokenizer, conversations: list[list[dict]], layers: list[int], *,
            with_logprobs: bool = False, batch_size: int = 8, max_length: int = 1024,
            max_response_tokens: int = 256, progress: bool = False) -> list[Capture]:
    """One :class:`Capture` per conversation (each ending with the assistant's response).

    An empty response is represented by the state at the last prompt token
    (the position that chose to stop), so every capture has at least one row.
    """
    from tqdm.auto import tqdm

    n_hidden = model.config.num_hidden_layers
    bad = [l for l in layers if not 0 <= l <= n_hidden]
    if bad:
        raise ValueError(f"layer ids {bad} out of range 0..{n_hidden} for this model")
    encoded = []
    for conv in conversations:
        prompt_messages, response = split_conversation(conv)
        encoded.append(_encode(tokenizer, prompt_messages, response, max_length, max_response_tokens))
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]) + len(encoded[i][1]))
    out: list[Capture | None] = [None] * len(encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    backbone = _backbone(model)
    head = model.get_output_embeddings()
    bar = tqdm(total=len(encoded), desc="guard capture", disable=not progress, unit="resp")
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        seqs = [encoded[i][0] + encoded[i][1] for i in idx]
        width = max(len(s) for s in seqs)
        # right padding keeps position ids 0..n-1 for every row, as in an unpadded pass
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s)] = 1
        res = backbone(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        hs = res.hidden_states
        for r, i in enumerate(idx):
            p_len, r_len = len(encoded[i][0]), len(encoded[i][1])
            lo, hi = (p_len, p_len + r_len) if r_len else (p_len - 1, p_len)
            states = {l: hs[l][r, lo:hi].float().cpu() for l in layers}
            cap = Capture(states=states, n_tokens=r_len)
            if with_logprobs and r_len:
                # position t predicts token t+1: response tokens are predicted from p_len-1 .. end-1
                logits = head(hs[-1][r, p_len - 1 : p_len + r_len - 1]).float()
                logp = torch.log_softmax(logits, dim=-1)
                target = ids[r, p_len : p_len + r_len].to(logp.device)
                cap.token_logprobs = logp.gather(1, target[:, None])[:, 0].cpu()
                cap.token_entropies = -(logp.exp() * logp).sum(-1).cpu()
            elif with_logprobs:
                cap.token_logprobs = torch.zeros(0)
                cap.token_entropies = torch.zeros(0)
            out[i] = cap
        bar.update(len(idx))
    bar.close()
    return out  # type: ignore[return-value]


class GenerationRecorder:
    """Record the guard layers' states while the transformers engine generates (no extra forward pass).

    ``model.generate`` runs one prefill forward per batch (all prompt positions,
    left-padded) and then one forward per new token, fed the token chosen last:
    the step that feeds response token ``k`` yields its states, which is where a
    teacher-forced pass would put them. The last token of a response cut by the
    length limit is never fed back, so it has no state (the teacher-forced pass
    would have one more row). Layer ``l`` is recorded at the output of block
    ``l - 1``, the final norm for the last layer, and the embeddings for 0, so the
    values equal ``output_hidden_states[l]``.
    """

    def __init__(self, model, layers: list[int]):
        self.model, self.layers = model, layers
        self.chunks: list[dict] = []  # per generate() batch: {"last_prompt": {l: (B,d)}, "steps": [{l: (B,d)}]}
        self._step: dict[int, torch.Tensor] = {}
        self._handles = []

    def __enter__(self):
        base = _backbone(self.model)
        n = self.model.config.num_hidden_layers
        for l in self.layers:
            if l == 0:
                module = base.embed_tokens
            elif l == n and getattr(base, "norm", None) is not None:
                module = base.norm
            else:
                module = base.layers[l - 1]
            self._handles.append(module.register_forward_hook(self._hook(l)))
        self._handles.append(base.register_forward_hook(self._end_of_forward))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, layer):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            self._step[layer] = out.detach()

        return hook

    def _end_of_forward(self, _module, _inputs, _output):
        step, self._step = self._step, {}
        if not step:
            return
        width = next(iter(step.values())).shape[1]
        if width > 1 or not self.chunks:  # a prefill starts a new batch
            self.chunks.append({"last_prompt": {l: s[:, -1].float().cpu() for l, s in step.items()}, "steps": []})
        else:
            self.chunks[-1]["steps"].append({l: s[:, 0].float().cpu() for l, s in step.items()})

    def captures(self, completions, batch_sizes: list[int]) -> list[Capture]:
        """One Capture per completion, given how many rows each generate() batch had (in order)."""
        if len(batch_sizes) != len(self.chunks):
            raise RuntimeError(f"recorded {len(self.chunks)} generate batches, expected {len(batch_sizes)}")
        out, k = [], 0
        for chunk, size in zip(self.chunks, batch_sizes):
            steps = chunk["steps"]
            for r in range(size):
                comp = completions[k]
                k += 1
                n = min(comp.completion_tokens, len(steps))
                if n == 0:
                    states = {l: chunk["last_prompt"][l][r : r + 1] for l in self.layers}
                else:
                    states = {l: torch.stack([steps[t][l][r] for t in range(n)]) for l in self.layers}
                out.append(Capture(states=states, n_tokens=comp.completion_tokens))
        return out
