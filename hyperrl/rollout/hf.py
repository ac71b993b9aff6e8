"""The transformers rollout engine (the CPU default): batched sampling with a KV cache.

Log-prob choice (documented, tested): the returned ``rollout_logprobs`` are the log-probs of the
distribution the token was *actually sampled from* — logits / temperature, then top-k and top-p
truncation, renormalised. Peers got this wrong (vLLM log-probs before temperature, TRL #4159;
top-p renormalisation, TRL #6789). With ``top_k=0, top_p=1`` they equal the trainer's
``token_logprobs(logits, tokens, temperature)``; with truncation the trainer's (untruncated)
log-probs differ by the truncated mass, which the mismatch correction sees.
"""

from __future__ import annotations

import contextlib

import torch
from tensordict import TensorDict

from hyperrl.multimodal import forward_inputs, pack_vision, vision_spec
from hyperrl.rollout.attention import use_gqa_sdpa
from hyperrl.rollout.base import SamplingParams, TransactionalEngine, WeightPublishError, transformers_capabilities
from hyperrl.rollout.decode import DECODE, decode_step, why_not
from hyperrl.rollout.kv_cache import full_attention_only, preallocated_cache
from hyperrl.rollout.requests import Request, keyed_sample, keyed_uniform
from hyperrl.routing import Routing, is_moe
from hyperrl.trajectory import FINISH_REASONS, NO_VERSION, check_vision, make_trajectory

__all__ = ["TransformersEngine", "filter_logits"]

_ABORTED = FINISH_REASONS.index("aborted")


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """fp32 ``logits / temperature`` with tokens outside top-k / the top-p nucleus set to −inf. ``[B, V]``
    (never written in place: at temperature 1 an fp32 ``logits`` comes back as it is)."""
    z = logits.float() if temperature == 1.0 else logits.float() / temperature
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, idx = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, -1)
        # drop a token when the mass strictly before it already reaches top_p (the top token stays)
        drop = (torch.cumsum(probs, -1) - probs) >= top_p
        z = z.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return z


def _run_length(ctx: list[tuple]) -> int:
    """``n`` when ``ctx`` is consecutive runs of exactly ``n`` identical items (else 1)."""
    runs, i = [], 0
    while i < len(ctx):
        j = i
        while j < len(ctx) and ctx[j] == ctx[i]:
            j += 1
        runs.append(j - i)
        i = j
    return runs[0] if len(set(runs)) == 1 else 1


class TransformersEngine(TransactionalEngine):
    """Serve a ``transformers`` causal LM; ``generate`` returns trajectory batches.

    ``shared=True``: ``model`` is the trainer's own policy (one process, same device and dtype) —
    no second copy, and publication is a version bump: the transaction still checks every
    parameter (complete, finite) before the bump, but the weights were changed in place by the
    optimizer, so a refused publication cannot fall back to ``V``: the engine then refuses to
    generate (the run fails closed) instead of serving unpublished weights."""


    def __init__(self, model, *, device: str | torch.device = "cpu", version: int = 0, pad_id: int = 0,
                 shared: bool = False, decode: str = "auto"):
        if decode not in DECODE:
            raise ValueError(f"decode={decode!r}: one of {DECODE}")
        self.model = model.to(device)
        if not shared:  # the engine's own copy: grouped K/V never repeated per decoded token (a shared model is
            self.model.eval()  # the trainer's, switched as it was built: hyperrl.compose)
            use_gqa_sdpa(self.model)
        self.device = torch.device(device)
        self.pad_id, self.shared = pad_id, shared
        # generate_requests: keyed sampling, abort, resume; a mixture of experts' routes recorded
        self.capabilities = transformers_capabilities(share_weights=shared)
        self._routing = Routing(self.model) if is_moe(self.model) else None
        self._vision = vision_spec(self.model)  # a vision-language model: images beside the prompts
        self._version, self._failed = version, None
        self._full_attention = full_attention_only(self.model)  # the in-place KV cache fits its layers
        self.decode, self.decode_reason = decode, None  # decode_reason: why the last generation used the model's
        if decode == "hyperrl" and (why := why_not(self.model)):
            raise ValueError(f"decode=hyperrl: the engine's own decode step cannot run this model: {why}; "
                             "use decode: auto (the model's forward where it cannot) or decode: model")
        self._undo: list = []  # (weight, undo) of the deltas applied in place by the open publication
        # tied weights appear under several state-dict names; a publisher may send one of them
        canon: dict[int, str] = {}
        for name, p in self.model.named_parameters():
            canon.setdefault(p.data_ptr(), name)
        self._aliases = {k: canon[v.data_ptr()] for k, v in self.model.state_dict().items()
                         if v.data_ptr() in canon and canon[v.data_ptr()] != k}

    @property
    def policy_version(self) -> int:
        return self._version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def layout(self, replicas: int = 1):
        """Every parameter whole (no tensor parallelism) on each of ``replicas`` copies (a ``dp`` axis)."""
        from hyperrl.sharding import Mesh, Spec, plain_destination

        return plain_destination({k: (tuple(p.shape), p.dtype, Spec.replicate(p.dim()))
                                  for k, p in self.model.named_parameters()}, Mesh.of(dp=replicas))

    def _expected(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def _apply(self, staged: dict[str, torch.Tensor], version: int) -> None:
        current = self.model.state_dict()
        with torch.no_grad():
            for name, t in staged.items():
                if t.data_ptr() != current[name].data_ptr():  # shared weights (and applied deltas) are in place
                    current[name].copy_(t.to(current[name].dtype))
        self._failed, self._undo = None, []

    def stage_deltas(self, deltas) -> None:
        """Apply each delta in place to the weight served now (:func:`~hyperrl.rollout.delta.apply_delta_`: its
        checksum verified, an undo kept) and stage that weight itself — the commit copies nothing; a refusal or
        an abort undoes every delta applied so far, so the engine serves ``V`` bit for bit. Only a delta's new
        elements are checked finite (the others were when ``V`` was committed). Over the trainer's own weights
        (``shared``): the transaction's copying path."""
        if self.shared:
            return super().stage_deltas(deltas)
        from hyperrl.rollout.delta import apply_delta_

        if self._txn is None:
            raise WeightPublishError("stage_deltas() without begin(version, base=...)")
        current, txn = self._expected(), self._txn
        try:
            with torch.no_grad():
                for name, d in (deltas.items() if hasattr(deltas, "items") else deltas):
                    txn.check_delta(name, d)
                    t = current[name]
                    self._undo.append((t, apply_delta_(t, d, name)))
                    txn.add(name, t, finite_checked=d.elementwise)
        except Exception:
            self.abort()
            raise

    def _on_abort(self) -> None:
        from hyperrl.rollout.delta import undo_delta_

        with torch.no_grad():
            for t, undo in reversed(self._undo):  # deltas applied in place: V restored exactly
                undo_delta_(t, undo)
        self._undo = []
        if self.shared:  # the served weights are the trainer's: they no longer equal version V
            self._failed = "a publication was refused while the engine shares the trainer's weights"

    @contextlib.contextmanager
    def _eval(self):
        """Eval mode for a generation (over shared weights the trainer's train mode is restored after)."""
        was = self.model.training
        if was:
            self.model.eval()
        try:
            yield
        finally:
            if was:
                self.model.train()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1, *,
                 group_offset: int = 0, vision: list | None = None) -> TensorDict:
        """``vision``: a vision-language model's images, one ``(pixel_values, image_grid_thw)`` (or None) per
        prompt, whose placeholders are in the prompt's ids already; the rows carry them (``hyperrl.multimodal``)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: need at least one prompt, each with at least one token")
        if n < 1:
            raise ValueError(f"n={n}: must be ≥ 1")
        if self._failed:
            raise WeightPublishError(f"{self._failed}; refusing to generate from unpublished weights (the run "
                                     f"fails closed)")
        self._check_vision(vision, len(prompts))
        with self._eval():
            return self._generate(prompts, sampling, n, group_offset, vision=vision)

    def _check_vision(self, vision, count: int) -> None:
        if vision is None:
            return
        if self._vision is None and any(v is not None for v in vision):
            raise ValueError(f"vision: images given to {type(self.model).__name__}, a text-only model; serve a "
                             "vision-language model (model.vision) or drop the images")
        if len(vision) != count:
            raise ValueError(f"vision: {len(vision)} entries for {count} prompts (one per prompt, None for none)")

    def _agree(self, tok: torch.Tensor) -> torch.Tensor:
        """The sampled tokens every rank serving this engine continues with (one process: these)."""
        return tok

    @torch.no_grad()
    def generate_requests(self, requests: list[Request], sampling: SamplingParams, *, abort=None,
                          hold=None) -> TensorDict:
        """Continue every :class:`~hyperrl.rollout.requests.Request` from ``prompt + partial``
        (re-prefill) for up to ``max_new_tokens − len(partial)`` more tokens (the request's own
        ``max_new_tokens`` when lower), sampling keyed by
        ``(sampling.seed, uid, response index)``. ``abort`` (anything with ``is_set()``, e.g. a
        ``threading.Event``) is checked before every decode step: once set, unfinished rows stop
        and return ``finish_reason = aborted`` with their tokens so far. ``hold`` (anything with
        ``wait()``) is called before every decode step after that check: it may block while a
        publication replaces the weights in place, and the generation then continues over its KV
        cache, computed by the older weights — each token stamped with the version that sampled it,
        and ``kv_version`` (the cache's oldest version: the version at this call's prefill) recorded
        per token. Rows carry ``sample_uid``, ``token_version`` (the partial tokens keep theirs) and
        ``policy_version`` = the oldest."""
        if not requests:
            raise ValueError("requests: empty")
        if sampling.seed is None:
            raise ValueError("sampling.seed: keyed sampling needs a seed (the randomness is keyed by seed, "
                             "sample_uid and token index)")
        budgets = torch.tensor([r.budget(sampling.max_new_tokens) for r in requests])
        if bool((budgets < 1).any()):
            r = requests[int((budgets < 1).nonzero()[0])]
            raise ValueError(f"Request {r.uid}: {len(r.partial)} tokens generated already, no budget left under "
                             f"max_new_tokens={r.budget(sampling.max_new_tokens) + len(r.partial)}; it is finished "
                             "(length), not resumable")
        if self._failed:
            raise WeightPublishError(f"{self._failed}; refusing to generate from unpublished weights")
        uids = torch.tensor([r.uid for r in requests])
        offsets = torch.tensor([len(r.partial) for r in requests])
        ctx = [tuple(r.prompt) + tuple(r.partial) for r in requests]
        vision = [r.vision for r in requests] if any(r.vision is not None for r in requests) else None
        self._check_vision(vision, len(requests))
        # a fresh group: n identical contexts in a row share one prefill (the same images too: same objects)
        n = _run_length(ctx if vision is None else [(c, id(v)) for c, v in zip(ctx, vision)])
        steps: list[int] = []  # the version each decode step ran at (a held publication changes it mid-call)
        with self._eval():
            b = self._generate([list(c) for c in ctx[::n]], sampling, n, 0, keys=(uids, offsets), budgets=budgets,
                               abort=abort, hold=hold, versions=steps, vision=None if vision is None else vision[::n])
        act, lp, tv = b["action_mask"].clone(), b["rollout_logprobs"].clone(), b["token_version"].clone()
        kv = torch.full_like(tv, NO_VERSION)
        if steps:  # generated index g of row i sits at len(ctx_i) + g
            g = torch.arange(tv.shape[1])[None, :] - torch.tensor([len(c) for c in ctx])[:, None]
            tv = torch.where(act, torch.tensor(steps)[g.clamp(0, len(steps) - 1)], tv)
            kv = torch.where(act, steps[0], kv)
        routes = b["routed_experts"].clone() if "routed_experts" in b.keys() else None
        for i, r in enumerate(requests):  # the partial tokens are actions sampled under older weights
            P, K = len(r.prompt), len(r.partial)
            if K and routes is not None and r.partial_routes is not None:  # they keep the routes they ran with
                pr = r.partial_routes.to(routes.dtype)
                routes[i, P:P + K] = torch.where(pr >= 0, pr, routes[i, P:P + K])
            if K:
                act[i, P:P + K] = True
                lp[i, P:P + K] = torch.tensor(r.partial_logprobs)
                tv[i, P:P + K] = torch.tensor(r.partial_versions)
                kv[i, P:P + K] = torch.tensor(r.partial_kv_versions or r.partial_versions)
        oldest = torch.where(act, tv, torch.iinfo(torch.int64).max).min(-1).values
        extra = {"kv_version": kv} if hold is not None else {}
        if routes is not None:
            extra["routed_experts"] = routes
        return make_trajectory(**{**b.to_dict(), "action_mask": act, "rollout_logprobs": lp, "token_version": tv,
                                  "policy_version": torch.where(act.any(-1), oldest, self._version),
                                  "sample_uid": uids, "group_id": torch.tensor([r.group_id for r in requests]),
                                  **extra})

    def _generate(self, prompts, sampling: SamplingParams, n: int, group_offset: int, *, keys=None, budgets=None,
                  abort=None, hold=None, versions: list | None = None, vision: list | None = None) -> TensorDict:
        """``keys = (uids [B], offsets [B])``: keyed sampling (else one generator stream);
        ``budgets [B]``: per-row token limits; ``abort``: checked before every decode step, then
        ``hold.wait()``; ``versions``: gets the serving version of every decode step; ``vision``: one
        ``(pixel_values, image_grid_thw)`` or None per prompt (a vision-language model: the prefill reads the
        images, positions are M-RoPE's — ``[3, B, P]`` — and decoding continues them on every axis)."""
        rows = [list(p) for p in prompts for _ in range(n)]
        groups = torch.tensor([group_offset + i for i in range(len(prompts)) for _ in range(n)])
        B, P, dev = len(rows), max(len(p) for p in rows), self.device
        # left-pad for batched decoding (one tensor built from lists: no per-row tensor)
        ids = torch.tensor([[self.pad_id] * (P - len(p)) + p for p in rows], dtype=torch.long, device=dev)
        attn = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in rows], dtype=torch.long, device=dev)
        gen = torch.Generator(device=dev)
        if sampling.seed is not None:
            gen.manual_seed(sampling.seed)
        else:
            gen.seed()
        out_tok = torch.full((B, sampling.max_new_tokens), self.pad_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros(B, sampling.max_new_tokens, dtype=torch.float32, device=dev)
        alive = torch.ones(B, dtype=torch.bool, device=dev)
        stopped, aborted = torch.zeros_like(alive), torch.zeros_like(alive)
        stops = torch.tensor(sampling.stops, dtype=torch.long, device=dev)
        lengths = torch.zeros(B, dtype=torch.long, device=dev)
        pos = (attn.cumsum(-1) - 1).clamp_min(0)  # [B, P]; a vision-language model: [3, B, P]
        images, prefill_kw = None, {}
        if self._vision is not None:
            images = pack_vision(list(vision) if vision is not None else [(None, None)] * len(prompts))
            prefill_kw = forward_inputs(self.model, self._vision, ids[::n], attn[::n], images)
            pos = prefill_kw.pop("position_ids").repeat_interleave(n, 1)
        past = step_ids = None
        steps = sampling.max_new_tokens if budgets is None else int(budgets.max())
        routing, routes = self._routing, None  # a mixture of experts: the experts each token is routed to
        if routing is not None:  # (prompt [B, P, L, k] from the prefill, generated [B, steps, L, k])
            routes = [None, torch.full((B, steps, routing.layers, routing.top_k), -1, dtype=torch.int16)]
        record = routing.call if routing is not None else contextlib.nullcontext
        rows_c = torch.arange(B, device=dev)  # the rows still computed (keyed sampling drops finished ones)
        own = self._decode_step(routing is not None or self._vision is not None)
        for t in range(steps):
            if abort is not None and abort.is_set():
                aborted = alive.clone()
                break
            if hold is not None:
                hold.wait()  # a publication may replace the weights here; the cache stays
            if versions is not None:
                versions.append(self._version)
            # only the last position's logits are needed: no [B, P, V] prefill logits (a large saving at
            # real vocabularies)
            if t == 0:  # prefill each prompt once; its n samples share the KV cache rows
                with record():
                    cache = self._cache(P + steps)
                    out = self.model(input_ids=ids[::n], attention_mask=attn[::n], position_ids=pos[..., ::n, :],
                                     use_cache=True, logits_to_keep=1,
                                     **({"past_key_values": cache} if cache is not None else {}), **prefill_kw)
                past, logits = out.past_key_values, out.logits[:, -1].repeat_interleave(n, 0)
                if n > 1:
                    past.batch_repeat_interleave(n)
                if routes is not None:
                    routes[0] = routing.used.view(B // n, P, routing.layers, routing.top_k).repeat_interleave(n, 0)
            elif own is not None:  # the engine's own step (hyperrl.rollout.decode): the same weights, fewer ops
                if own.version != self._version:  # a held publication replaced the weights: take them again
                    own = self._decode_step(False)
                logits = own(step_ids[:, 0], pos, past, attn)
            else:
                with record():  # this step runs the tokens sampled at t − 1
                    out = self.model(input_ids=step_ids, attention_mask=attn, position_ids=pos, past_key_values=past,
                                     use_cache=True, logits_to_keep=1)
                past, logits = out.past_key_values, out.logits[:, -1]
                if routes is not None:
                    routes[1][rows_c.cpu(), t - 1] = routing.used
            z = filter_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
            logp = torch.log_softmax(z, -1)
            # one uniform a row → the token by inverse CDF: from the generator, or keyed by (seed, uid, index)
            # (torch.multinomial's exponential race took 0.28 ms a step at 128 × 92 and 0.44 s at 128 × 151,936;
            # this 0.05 ms / 0.12 s)
            u = (torch.rand(rows_c.numel(), generator=gen, dtype=torch.float64, device=dev) if keys is None else
                 keyed_uniform(sampling.seed, keys[0][rows_c.cpu()], keys[1][rows_c.cpu()] + t))
            tok = keyed_sample(logp, u).to(dev)
            live = alive[rows_c]
            tok = torch.where(live, self._agree(tok), self.pad_id)
            out_tok[rows_c, t] = tok
            out_lp[rows_c, t] = torch.where(live, logp.gather(-1, tok[:, None])[:, 0], 0.0)
            lengths += alive.long()
            if stops.numel():
                stopped = stopped | (alive & torch.isin(out_tok[:, t], stops))
                alive = alive & ~stopped
            if budgets is not None:
                alive = alive & (lengths < budgets.to(dev))
            if not alive.any():
                break
            live = alive[rows_c]
            if keys is not None and int(live.sum()) * 2 <= rows_c.numel():
                # half the computed rows have finished: compute only the live ones from here (their tokens
                # are keyed by row, not by batch position; the n samples' shared cache rows are split already)
                keep = live.nonzero()[:, 0]
                past.batch_select_indices(keep)
                rows_c, tok, attn, pos = rows_c[keep], tok[keep], attn[keep], pos[..., keep, :]
            step_ids = tok[:, None]
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)  # finished rows' outputs are unused
            # the next position: one past the largest so far (M-RoPE: over the three axes — a prompt may end on
            # an image, whose last placeholder's axes differ)
            pos = (pos[..., -1:].amax(0, keepdim=True).expand_as(pos[..., -1:]) if pos.dim() == 3 else
                   pos[..., -1:]) + 1
        plen = torch.tensor([len(p) for p in rows])
        finish = torch.where(aborted, _ABORTED, torch.where(stopped, 0, 1)).cpu()  # aborted / stop / length
        if images is not None:  # every row carries its prompt's images
            images = {k: v.repeat_interleave(n, 0) for k, v in images.items()}
        return self._trajectory(ids.cpu()[:, :P], plen, out_tok.cpu(), out_lp.cpu(), lengths.cpu(), groups, finish,
                                routes, images)

    def _decode_step(self, special: bool):
        """The decode step this generation runs (None: the model's forward): :mod:`hyperrl.rollout.decode`'s
        where ``decode`` allows it and the model is one it runs — checked per generation, since hooks come and go
        (``decode=hyperrl`` refuses then); never for routed or vision models (``special``: their forward records
        routes / reads M-RoPE positions)."""
        self.decode_reason = "decode=model" if self.decode == "model" else None
        if self.decode == "model":
            return None
        step, why = (None, "a mixture of experts or a vision model") if special else decode_step(self.model)
        if why and self.decode == "hyperrl":
            raise ValueError(f"decode=hyperrl: the engine's own decode step cannot run this model: {why}")
        self.decode_reason = why
        if step is not None:
            step.version = self._version  # the weights it was built over
        return step

    def _cache(self, capacity: int):
        """The decode's KV cache: written in place for the whole generation (:mod:`hyperrl.rollout.kv_cache`)
        where every layer attends to the whole past; else transformers' own (None)."""
        return preallocated_cache(capacity) if self._full_attention else None

    def _trajectory(self, left_ids, plen, out_tok, out_lp, lengths, groups, finish=None, routes=None,
                    images=None) -> TensorDict:
        """Left-padded prompts ``[B, P]`` + generated ``[B, N]`` → right-padded rows (vectorised);
        ``routes = (prompt [B, P, L, k], generated [B, N, L, k])`` → ``routed_experts`` (−1 where no
        forward ran the token: a row's last, padding)."""
        B, P = left_ids.shape
        total = plen + lengths
        T = int(total.max())
        j = torch.arange(T)[None, :]
        in_prompt = j < plen[:, None]
        in_gen = (j >= plen[:, None]) & (j < total[:, None])
        p_idx = (P - plen[:, None] + j).clamp(0, P - 1)
        g_idx = (j - plen[:, None]).clamp(0, out_tok.shape[1] - 1)
        tokens = torch.where(in_prompt, left_ids.gather(1, p_idx),
                             torch.where(in_gen, out_tok.gather(1, g_idx), self.pad_id))
        lp = torch.where(in_gen, out_lp.gather(1, g_idx), 0.0)
        extra = {} if finish is None else {"finish_reason": finish}
        extra.update(images or {})  # pixel_values [B, P, D], image_grid_thw [B, I, 3] (hyperrl.multimodal)
        if routes is not None and routes[0] is not None:
            b = torch.arange(B)[:, None]
            gen = routes[1][b, g_idx.clamp_max(max(routes[1].shape[1] - 1, 0))] if routes[1].shape[1] else None
            none = torch.full((B, T, *routes[0].shape[2:]), -1, dtype=torch.int16)
            extra["routed_experts"] = torch.where(in_prompt[..., None, None], routes[0][b, p_idx],
                                                  none if gen is None else torch.where(in_gen[..., None, None], gen,
                                                                                       none))
        out = make_trajectory(tokens=tokens, attention_mask=in_prompt | in_gen, action_mask=in_gen,
                              rollout_logprobs=lp, policy_version=torch.full((B,), self._version, dtype=torch.long),
                              token_version=torch.where(in_gen, self._version, NO_VERSION),
                              group_id=groups, reward=torch.zeros(B), **extra)
        if images is not None:  # every row's placeholders against its images, where the rows are made
            check_vision(out, image_token_id=self._vision.image_token_id, merge=self._vision.merge)
        return out
