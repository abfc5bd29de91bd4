"""The client side, once for both engines: a `Client` (its name, its data, its
state), its round (`train_client`: the round's minibatches, then
`local_round`: start as the method says, T local steps, send a message) and
its scores (`score_client`).

The in-process engine and the Flower ClientApp both call these, so a
method's client rule runs the same way everywhere. A round also measures, at
no extra forward or backward pass, what the paper's analyses need: the
gradient signal-to-noise ratio (GSNR) of the round's minibatch gradients and
the size of the update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from ..model.base_cache import base_generations
from ..errors import TrainingDiverged, UserError
from ..evaluate import generate, rouge_l
from ..methods.base import Message, Method, Params, State, StepContext, aligned, in_order, zeros_like
from ..params import flat_where_it_helps
from ..optim import make_optimizer, round_lr
from ..data.clients import ClientShare
from ..prompts import IGNORE, Encoded, batch_indices, collate_train, encode_prompt, encode_train
from ..settings import RunConfig


class GradientStats:
    """Per-coordinate mean and unbiased variance of a round's minibatch gradients (Welford, float64).

    GSNR_i = mean(g_i)² / var(g_i) over the round's T steps; coordinates with
    zero variance are left out, and so are tensors the method keeps frozen
    (`Method.trains`: FFA-LoRA's and FedSVD's A), whose gradients never move the model. Two summaries:
    ``gsnr_mean`` — the mean of GSNR_i over the coordinates kept;
    ``gsnr_ratio`` — ‖mean g‖² / Σ_i var(g_i) over all coordinates.
    Both are None with fewer than two steps (no variance).

    Tensor by tensor on the CPU on purpose: a LoRA tensor stays in cache through the few
    operations of an update (faster than one concatenated vector, where every
    operation streams all coordinates through memory); on CUDA, where each operation is a
    kernel launch, once over the flat buffers (`params.aligned`; the summary's sums then
    round differently in their last bits). The summary syncs once, not per tensor.
    """

    def __init__(self):
        self.count = 0
        self.mean: dict[str, torch.Tensor] = {}
        self.m2: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def add(self, grads: Params) -> None:
        self.count += 1
        if not self.mean:  # one flat buffer each (params.empty_like says why)
            self.mean, self.m2 = zeros_like(grads, torch.float64), zeros_like(grads, torch.float64)
        for g, mean, m2 in aligned(grads, self.mean, self.m2):  # tensor by tensor, or flat on CUDA
            g = g.detach()
            delta = g - mean  # float64 by type promotion
            mean.add_(delta, alpha=1.0 / self.count)
            m2.addcmul_(delta, g - mean)

    def summary(self) -> tuple[float | None, float | None]:
        if self.count < 2:
            return None, None
        # Σ GSNR_i over kept coordinates, their number, ‖mean‖², Σ var
        totals = torch.zeros(4, dtype=torch.float64, device=next(iter(self.mean.values())).device)
        for mean, m2 in aligned(self.mean, self.m2):
            var = m2 / (self.count - 1)
            square = mean * mean
            kept = var > 0
            totals += torch.stack([torch.where(kept, square / var, 0.0).sum(), kept.sum(), square.sum(), var.sum()])
        gsnr_sum, kept, mean_sq, var_sum = totals.tolist()
        gsnr_mean = gsnr_sum / kept if kept else None
        gsnr_ratio = mean_sq / var_sum if var_sum > 0 else None
        return gsnr_mean, gsnr_ratio


def distance(a: Params, b: Params | None = None) -> float:
    """‖a − b‖ (or ‖a‖) over all tensors together."""
    total = 0.0
    for t, *other in aligned(a) if b is None else aligned(a, b):  # tensor by tensor, or flat on CUDA
        d = t.detach().double() if b is None else t.detach().double() - other[0].double()
        total += float((d * d).sum())
    return math.sqrt(total)


@dataclass
class ClientRound:
    """What a client's round produced, for the server and for the metrics."""

    message: Message  # sent to the server
    personalized: Params  # the client's personalized adapter after this round
    losses: list[float]  # minibatch loss of each local step
    gsnr_mean: float | None
    gsnr_ratio: float | None
    update_norm: float  # ‖w_{k,T} − w^r‖
    model_norm: float  # ‖w_{k,T}‖
    method_metrics: dict[str, float] = field(default_factory=dict)  # Method.round_metrics
    # the client's round from its state file in to its next file out (in-process engine; None in Flower's)
    seconds: float | None = None


def _non_finite(params: Params) -> str | None:
    """The name of the first tensor holding a NaN or Inf, if any.

    One multi-tensor norm first (a NaN or Inf anywhere makes its tensor's norm
    non-finite), or one check of the flat buffer the tensors are views of (CUDA:
    params.aligned): the per-tensor search runs only when that sees something, so
    the usual case costs one call instead of one check and sync per tensor.
    """
    pieces = aligned(params)
    if len(pieces) == 1:  # one flat buffer (CUDA): one check
        if bool(torch.isfinite(pieces[0][0].detach()).all()):
            return None
    elif not pieces or torch.isfinite(torch.stack(torch._foreach_norm([p.detach() for (p,) in pieces]))).all():
        return None
    return next((n for n, p in params.items() if not torch.isfinite(p).all()), None)


def _diverged(what: str, round_index: int, step: int, lr: float) -> TrainingDiverged:
    """`what` (the loss, a gradient, a weight, the update) holds a NaN or Inf: the round stops."""
    return TrainingDiverged(
        f"non-finite value in {what} at round {round_index + 1}, local step {step + 1} (lr={lr:g}): "
        "try a lower learning rate"
    )


def accumulated_loss_and_grads(lm, microbatches: list[dict], total: Params | None) -> tuple[float, Params]:
    """The loss and gradient of one local step made of k microbatches (gradient accumulation):
    Σ_j (n_j / Σ n) (loss_j, ∇loss_j), n_j the response tokens of microbatch j, each loss_j the
    mean over its own tokens, so the sum is the mean over all the step's tokens, as one batch of
    them would give (up to float error). `total` is the buffer the gradients add into (zeroed
    here; the caller's, reused every step, like the model's .grad buffers)."""
    counts = [int((mb["labels"][:, 1:] != IGNORE).sum()) for mb in microbatches]
    tokens = sum(counts)
    for g in total.values():
        g.zero_()
    loss = 0.0
    for mb, count in zip(microbatches, counts):
        share = count / tokens
        part, grads = lm.loss_and_grads(mb)
        for n, g in grads.items():
            total[n].add_(g, alpha=share)
        loss += share * part
    return loss, total


def local_round(
    lm, method: Method, state: State, global_params: Params, received: Message,
    batches: Iterable[dict | list[dict]], lr: float, round_index: int,
    on_step: Callable[[int, float], None] | None = None, optimizer=None,
) -> ClientRound:
    """Run one round of `method`'s client rule on the live adapter of `lm`.

    `batches` holds the T minibatches of the round (a step's minibatch, or its list of
    microbatches with gradient accumulation); `lr` is the round's η (`round_lr`);
    `optimizer` the run's `config.OptimizerConfig` (None: SGD), whose optimizer is made
    fresh here, for this round only; `state` is the client's persistent method state and
    is updated in place.
    """
    batches = list(batches)
    accumulated = None  # the gradient buffer of accumulated steps, made at the first
    steps = LocalRound(method, state, global_params, received, len(batches), lr, round_index, optimizer,
                       lm.lora, lm.set_lora)
    for t, batch in enumerate(batches):
        def gradient(batch=batch):
            nonlocal accumulated
            if isinstance(batch, dict):
                return lm.loss_and_grads(batch)
            if accumulated is None:
                accumulated = zeros_like({n: p.detach() for n, p in lm.lora.items()})
            return accumulated_loss_and_grads(lm, batch, accumulated)

        loss = steps.step(t, gradient)
        if on_step is not None:
            on_step(t, loss)
    return steps.finish()


class LocalRound:
    """One client's round of `method`'s client rule, a step at a time, on the tensors `live` (its
    live adapter): made at the round's start (w_{k,0} from `client_start`, loaded with `load`),
    then `step(t, gradient)` for t = 0..T-1, then `finish()` → its `ClientRound`. `local_round`
    runs it on the model's one adapter; the lockstep engine (run/lockstep.py) runs several,
    each on its own adapter, their gradients computed together."""

    def __init__(self, method: Method, state: State, global_params: Params, received: Message, num_steps: int,
                 lr: float, round_index: int, optimizer, live: Params, load: Callable[[Params], None]):
        self.method, self.state, self.global_params, self.live = method, state, global_params, live
        self.num_steps, self.lr, self.round_index = num_steps, lr, round_index
        self.opt = make_optimizer(optimizer) if optimizer is not None else None
        # the round's scratch (pFLAlign's m, SCAFFOLD's c): apart from `state`, dropped when it ends
        self.scratch = method.new_scratch()
        load(method.client_start(global_params, state, received, self.scratch))
        self.stats = GradientStats()
        frozen = [n for n in live if not method.trains(n)]  # left out of the GSNR (FFA-LoRA's A)
        self.trained = [n for n in live if method.trains(n)] if frozen else None
        self.losses: list[float] = []

    def step(self, t: int, gradient: Callable[[], tuple[float, Params]]) -> float:
        """Local step t; `gradient()` → (loss, grads) at the live tensors (called with autograd on,
        once or more: SAM's second call). Returns the step's loss."""
        round_index, lr = self.round_index, self.lr
        first_call = [True]

        def grad_fn():
            with torch.enable_grad():  # once here, for every method's `local_step` (which runs without)
                loss, grads = gradient()
            if not math.isfinite(loss):
                raise _diverged("the loss", round_index, t, lr)
            if bad := _non_finite(grads):
                raise _diverged(f"the gradient of {bad}", round_index, t, lr)
            if first_call[0]:  # the minibatch gradient at w_{k,t} (SAM's second call is not)
                # the trained tensors only (FFA-LoRA's B: no flat buffer of their own, so on CUDA one
                # concatenated copy, params.flat_where_it_helps, for the sums to run flat)
                trained = grads if self.trained is None else flat_where_it_helps({n: grads[n] for n in self.trained})
                self.stats.add(trained)
                first_call[0] = False
            return loss, grads

        ctx = StepContext(round=round_index, step=t, num_steps=self.num_steps, lr=lr,
                          global_params=self.global_params, scratch=self.scratch)
        if self.opt is not None:
            ctx.optimizer = self.opt
        loss = self.method.local_step(self.live, grad_fn, self.state, ctx)
        if bad := _non_finite(self.live):
            raise _diverged(f"the weights {bad}", round_index, t, lr)
        self.losses.append(loss)
        return loss

    def finish(self) -> ClientRound:
        """The round's end: the message, the personalized adapter, the round's measurements."""
        method, state, global_params, live, scratch = self.method, self.state, self.global_params, self.live, self.scratch
        local = {n: p.detach() for n, p in live.items()}
        update_norm, model_norm = distance(local, global_params), distance(local)
        method_metrics = method.round_metrics(global_params, live, state, scratch)
        message = method.client_end(global_params, live, state, scratch)
        scratch.clear()  # the round's end: its scratch goes (freed now, as the old `del state["m"]` did)
        for group, params in message.items():
            if bad := _non_finite(params):
                raise _diverged(f"the update {group}/{bad}", self.round_index, self.num_steps - 1, self.lr)
        personalized = method.personalized(global_params, live, state)
        sent = message.get("params")
        if sent is not None and sent.keys() == personalized.keys() and all(
                torch.equal(a, b) for a, b in aligned(sent, in_order(personalized, sent))):  # (one sync on CUDA)
            # the adapter sent is the personalized one (w_{k,T} for most methods): hold it once,
            # 19.5 MB per client for SmolLM2 (aggregation only reads its messages: tested)
            personalized = sent
        gsnr_mean, gsnr_ratio = self.stats.summary()
        return ClientRound(message, personalized, self.losses, gsnr_mean, gsnr_ratio, update_norm, model_norm,
                           method_metrics)


# ---- a client, its round and its scores ------------------------------------------
@dataclass
class Client:
    """A client as an engine sees it: its name and data, and its persistent state."""

    id: int
    data: ClientShare  # its name and its examples (from the partition step)
    # its tokenized training examples, or the function that tokenizes them on first use
    # (`train`): with hundreds of clients, only the sampled ones are ever tokenized
    encoded: list[Encoded] | Callable[[], list[Encoded]]
    state: State | None  # the method's per-client state (kept across rounds; None: not loaded)
    personalized: Params | None = None  # its personalized adapter after its last round
    steps_taken: int = 0  # minibatches consumed: the data sampler's whole state

    @property
    def name(self) -> str:
        return self.data.name

    @property
    def train(self) -> list[Encoded]:
        """The tokenized training examples (tokenized here on first use, then kept)."""
        if callable(self.encoded):
            self.encoded = self.encoded()
        return self.encoded

    @property
    def tokenized(self) -> bool:
        return not callable(self.encoded)

    @property
    def n_train(self) -> int:
        return len(self.data.train)


def make_client(k: int, data: ClientShare, tokenizer, cfg: RunConfig, state: State | None,
                encoded: list[Encoded] | Callable[[], list[Encoded]] | None = None) -> Client:
    """Client k (checked against batch_size). `encoded`: its training examples' token ids, or a
    function that returns them (data_cache.client_data); by default they are tokenized here on
    first use (`Client.train`), not now."""
    step_size = cfg.batch_size * cfg.optimizer.grad_accumulation
    if len(data.train) < step_size:
        raise UserError(
            f"client {k} ({data.name}) has {len(data.train)} training examples, fewer than batch_size={cfg.batch_size}"
            + (f" x optimizer.grad_accumulation={cfg.optimizer.grad_accumulation}"
               if cfg.optimizer.grad_accumulation > 1 else "")
        )
    conversation = next((ex for ex in data.train if ex.messages is not None), None)
    if conversation is not None:  # a chat template that cannot split conversations fails now, not in round 1
        encode_train(tokenizer, conversation, cfg.max_seq_len, cfg.data.template)
    if encoded is None:
        encoded = lambda: [encode_train(tokenizer, ex, cfg.max_seq_len, cfg.data.template)  # noqa: E731
                           for ex in data.train]
    return Client(k, data, encoded, state)


def draw_batches(client: Client, cfg: RunConfig, pad_id: int) -> list[dict | list[dict]]:
    """The client's T minibatches of its next round (advances `steps_taken`): a pure
    function of (seed, client, step), wherever the client runs. With gradient accumulation
    (k = optimizer.grad_accumulation > 1) a step draws batch_size × k examples, the very
    examples one batch of that size would hold, as k microbatches of batch_size."""
    k = cfg.optimizer.grad_accumulation
    batches = []
    for _ in range(cfg.local_steps):
        idx = batch_indices(client.n_train, cfg.batch_size * k, client.steps_taken, cfg.seed * 1009 + client.id)
        examples = [client.train[i] for i in idx]
        if k == 1:
            batches.append(collate_train(examples, pad_id))
        else:
            batches.append([collate_train(examples[j:j + cfg.batch_size], pad_id)
                            for j in range(0, len(examples), cfg.batch_size)])
        client.steps_taken += 1
    return batches


def client_lr(cfg: RunConfig, round_index: int) -> float:
    """The clients' η in round `round_index` (optimizer.schedule)."""
    opt = cfg.optimizer
    return round_lr(cfg.lr, opt.schedule, opt.min_lr, cfg.rounds, round_index)


def train_client(lm, method: Method, client: Client, global_params: Params, received: Message, cfg: RunConfig,
                 round_index: int, on_step: Callable[[int, float], None] | None = None) -> ClientRound:
    """Client's round `round_index`: its next T minibatches, `local_round`; keeps its personalized adapter."""
    batches = draw_batches(client, cfg, lm.tokenizer.pad_token_id)
    result = local_round(lm, method, client.state, global_params, received, batches, client_lr(cfg, round_index),
                         round_index, on_step, cfg.optimizer)
    client.personalized = result.personalized
    return result


def score_client(lm, test: list, adapter: Params | None, cfg: RunConfig, desc: str,
                 progress: bool) -> tuple[float, list[str]]:
    """ROUGE-L and generations on `test` with `adapter` (None: the base model, adapter switched off)."""
    prompts = [encode_prompt(lm.tokenizer, ex, cfg.max_seq_len, cfg.data.template)[0] for ex in test]
    if adapter is not None:
        lm.set_lora(adapter)

    def run_generation():
        with lm.model.disable_adapter() if adapter is None else lm.merged():
            return generate(lm.model, lm.tokenizer, prompts, cfg.eval.max_new_tokens, cfg.eval.batch_size,
                            desc=desc, progress=progress)

    if adapter is None:  # the base model's outputs are the same in every run of this split: cached
        preds = base_generations(lm, prompts, cfg.eval.max_new_tokens, cfg.eval.batch_size, run_generation)
    else:
        preds = run_generation()
    return rouge_l(preds, [ex.response for ex in test]), preds
