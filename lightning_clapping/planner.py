"""Where a run's bytes go, before it runs: ``plan(model, stages=4, replicas=2, tokens_per_step=16384, ...)``.

    python -m lightning_clapping.planner --hf-config qwen2.5-0.5b --stages 4 --replicas 2 --tokens 16384 \\
        --forward-codec q4 --backward-codec q8 --link-mbit 100 --delay-ms 25

The model is built on the meta device (no memory, no download) and cut by the strategy's own
:func:`~lightning_clapping.pipeline.partition.build_partition`. Per replica and optimizer step it counts:

* **activations**: every pipeline message as the wire lays it out (:func:`~lightning_clapping.comm.wire.
  message_nbytes`: header, a descriptor per tensor, padding). What crosses a cut is traced: one meta forward of a
  micro-batch records the tensors each cut module is called with: the hidden state (through the codec) and, in
  rotary models, the cos/sin tables and position ids, sent RAW (they do not require grad). Backward carries the
  gradients of those that require grad; the step's last one on each boundary also the step's results;
* **tied**: per group of k copies k (k - 1) payloads of the tensor (the tied codec's payload + a finite flag byte);
* **replica**: what each rank sends to its stage's replicas, summed over the replica's stages (ring all-reduce:
  2 (R - 1) / R of the buffer; DiLoCo's compressed all-gather: (R - 1) payloads; both once per ``inner_steps``).

``raw_*``: uncompressed every-step training of the same layout, floats as fp32 (the strategy's ``raw_bytes``).
Left out of the steady state: resize messages (16 bytes when a message's size changes) and the first step that
feedback variants send in full (:meth:`Plan.mean_over` adds both). Not modelled: values crossing a cut besides the
cut module's inputs (a residual of the parent's loop; none in Hugging Face decoders), padding masks (only
``input_ids`` is fed), parameters registered on spanning modules, the byte statistics' gather, and LAG's skip rate
(an argument: ``lag_send_fraction``).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_clapping.codecs import get_codec
from lightning_clapping.comm.replicas import ring_share
from lightning_clapping.comm.wire import HEADER_BYTES, message_nbytes, raw_payload_nbytes
from lightning_clapping.pipeline.partition import build_partition
from lightning_clapping.pipeline.schedule import one_f_one_b
from lightning_clapping.pipeline.timing import Link, step_time
from lightning_clapping.sync.config import LAG, DiLoCo, resolve

#: the step's results (loss, batch fingerprint) in the wire's 256-byte block; more with many logged values
RESULTS_BYTES = 256
_LLAMA = dict(model_type="llama", vocab_size=128256, num_attention_heads=32, num_key_value_heads=8,
              max_position_embeddings=131072)
#: published dimensions, written by hand (nothing is downloaded)
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, tie_word_embeddings=True),
    "llama-3.2-1b": dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         tie_word_embeddings=False),
    "tied-llama-32k": dict(model_type="llama", vocab_size=32000, hidden_size=256, intermediate_size=688,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                           max_position_embeddings=128, tie_word_embeddings=True),
}


@dataclass
class Plan:
    """Bytes per replica per optimizer step by kind, sent and uncompressed (``raw_*``), and the layout behind them."""

    stages: int
    replicas: int
    microbatches: int
    cut_points: tuple[str, ...]
    stage_param_bytes: tuple[int, ...]  #: trainable fp32 bytes per stage (a tied tensor on each stage holding it)
    activations: float
    tied: float
    replica: float
    raw_activations: float
    raw_tied: float
    raw_replica: float
    fwd_message_bytes: tuple[int, ...] = ()  #: one forward message per boundary (steady state)
    bwd_message_bytes: tuple[int, ...] = ()
    replica_mode: str = "every-step"
    notes: list[str] = field(default_factory=list)
    #: seconds, with link speeds: step_time_s = pipeline_s (1F1B) + tied_s + replica_s, none of them overlapped
    step_time_s: float | None = None
    pipeline_s: float | None = None
    tied_s: float | None = None
    replica_s: float | None = None
    total: float = field(init=False)
    raw_total: float = field(init=False)
    ratio: float = field(init=False)  #: raw_total / total

    def __post_init__(self) -> None:
        self.total = self.activations + self.tied + self.replica
        self.raw_total = self.raw_activations + self.raw_tied + self.raw_replica
        self.ratio = self.raw_total / self.total if self.total else 1.0

    def mean_over(self, steps: int, warm_start: bool = False) -> dict[str, float]:
        """Mean bytes per step by kind over a run's first ``steps`` steps, as the strategy's ``byte_totals`` count
        them: every message's first send announces its size (a 16-byte resize message), and under a feedback variant
        (``warm_start``) the first step is sent uncompressed and the second announces the compressed sizes again."""
        messages = 2 * (self.stages - 1) * self.microbatches
        acts = self.activations * steps + messages * HEADER_BYTES * (1 + (warm_start and steps > 1))
        acts += (self.raw_activations - self.activations) if warm_start else 0
        out = {"activations": acts / steps, "tied": self.tied, "replica": self.replica}
        return {**out, "total": sum(out.values())}

    def table(self) -> str:
        """The plan as plain text: MB per replica per optimizer step by kind, then stages and step time."""
        lines = [f"{self.stages} stages x {self.replicas} replicas, {self.microbatches} micro-batch(es); "
                 f"MB per replica per optimizer step\n{'kind':36s} {'sent MB':>12s} {'uncompressed MB':>16s} ratio"]
        for name, sent, raw in (("activations (fwd + bwd, all cuts)", self.activations, self.raw_activations),
                                ("tied copies' gradient sum", self.tied, self.raw_tied),
                                (f"replica sync ({self.replica_mode})", self.replica, self.raw_replica),
                                ("total", self.total, self.raw_total)):
            lines.append(f"{name:36s} {sent / 1e6:12.3f} {raw / 1e6:16.3f} {raw / sent if sent else 1:5.2f}x")
        lines.append("stage parameters (fp32 MB): " + ", ".join(
            f"{s}: {b / 1e6:.1f}" for s, b in enumerate(self.stage_param_bytes)))
        if self.step_time_s is not None:
            lines.append(f"step time {self.step_time_s:.3f} s = pipeline {self.pipeline_s:.3f} (1F1B) + tied sum "
                         f"{self.tied_s:.3f} + replica sync {self.replica_s:.3f} (not overlapped)")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def load_model(model: Any) -> tuple[nn.Module, Any]:
    """(module, its Hugging Face config or None) from a module, a config, a dict, a preset name or a JSON file."""
    if isinstance(model, nn.Module):
        return model, getattr(model, "config", None)
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(model, (str, Path)):
        model = PRESETS[str(model)] if str(model) in PRESETS else json.loads(Path(model).read_text())
    if isinstance(model, dict):
        model = AutoConfig.for_model(**model)
    with torch.device("meta"):  # in fp32 whatever the config's dtype: what the strategy trains and counts
        return AutoModelForCausalLM.from_config(model, dtype=torch.float32), model


def stage_parameters(module: nn.Module, partition: Any) -> list[list[torch.Size]]:
    """The shapes of every trainable parameter of each stage (a tied tensor once on each stage that holds it)."""
    modules = dict(module.named_modules())
    return [list({id(p): p.shape for u in partition.units_of(s) for p in modules[u].parameters()
                  if p.requires_grad}.values()) for s in range(partition.num_stages)]


class _CutsReached(Exception):
    """Every cut module has been called: the rest of the forward is not needed."""


def crossing_tensors(module: nn.Module, cuts: tuple[str, ...], batch: int, seq: int) -> list[list[tuple]] | None:
    """(shape, dtype, requires_grad) of the tensors each cut module is called with, from one forward of the model
    on ``input_ids`` of (batch, seq); None when that forward cannot run."""
    found: dict[int, list[tuple]] = {}

    def hook(i, _module, args, kwargs):
        found.setdefault(i, [(tuple(t.shape), t.dtype, t.requires_grad) for t in tree_flatten((args, kwargs))[0]
                             if isinstance(t, torch.Tensor)])
        if len(found) == len(cuts):
            raise _CutsReached

    hooks = [module.get_submodule(c).register_forward_pre_hook(partial(hook, i), with_kwargs=True)
             for i, c in enumerate(cuts)]
    try:
        module(input_ids=torch.zeros(batch, seq, dtype=torch.long, device=next(module.parameters()).device))
    except _CutsReached:
        pass
    except Exception:  # noqa: BLE001 - a model this forward cannot run: the caller falls back to the hidden size
        return None
    finally:
        for h in hooks:
            h.remove()
    return [found[i] for i in range(len(cuts))] if len(found) == len(cuts) else None


def _payload(shape: tuple, dtype: torch.dtype, codec: Any, compressible: bool) -> int:
    """Payload bytes of one tensor: through ``codec`` when it may be compressed, else its raw bytes; the codec
    "raw" is the uncompressed reference (floats as fp32, as the strategy's ``raw_bytes``)."""
    if codec == "raw":
        return 4 * math.prod(shape) if dtype.is_floating_point else raw_payload_nbytes(shape, dtype)
    if codec is not None and compressible and dtype.is_floating_point and math.prod(shape):
        return codec.payload_nbytes(shape, dtype)
    return raw_payload_nbytes(shape, dtype)


def activation_bytes(crossings: list[list[tuple]], microbatches: int, fwd_codec: Any,
                     bwd_codec: Any) -> tuple[float, list[int], list[int]]:
    """(bytes per step over every boundary, one forward and one backward message's bytes per boundary). Forward,
    the codec takes the tensors that require grad, the others go RAW; backward carries their gradients."""
    parts = [([(s, _payload(s, d, fwd_codec, g)) for s, d, g in tensors],
              [(s, _payload(s, d, bwd_codec, True)) for s, d, g in tensors if g and d.is_floating_point])
             for tensors in crossings]
    fwds, bwds = [message_nbytes(f) for f, _ in parts], [message_nbytes(b) for _, b in parts]
    results = sum(message_nbytes(b + [((RESULTS_BYTES,), RESULTS_BYTES)]) - n for (_, b), n in zip(parts, bwds))
    return microbatches * (sum(fwds) + sum(bwds)) + results, fwds, bwds


def tied_bytes(module: nn.Module, partition: Any, codec: Any) -> tuple[float, float, list[float]]:
    """(sent, fp32, sent by each stage) for one sum of the tied copies' gradients over the pipeline."""
    params = dict(module.named_parameters(remove_duplicate=False))
    sent, raw, per_stage = 0.0, 0.0, [0.0] * partition.num_stages
    for group in partition.tied:
        p, k = params[group.keys[0]], len(group.stages)
        payload = 4 * p.numel() if codec is None else codec.payload_nbytes(p.shape, torch.float32) + 1
        sent, raw = sent + k * (k - 1) * payload, raw + k * (k - 1) * 4 * p.numel()
        per_stage = [b + (k - 1) * payload * (s in group.stages) for s, b in enumerate(per_stage)]
    return sent, raw, per_stage


def replica_bytes(shapes: list[torch.Size], replicas: int, mode: Any, lag_send_fraction: float) -> tuple[float, float]:
    """(sent, every-step fp32 equivalent) by one rank of a stage with these parameters, per optimizer step."""
    if replicas == 1:
        return 0.0, 0.0
    share, numel = ring_share(replicas), sum(math.prod(s) for s in shapes)
    raw = share * (numel + len(shapes)) * 4  # fp32 gradients and a 4-byte presence flag per tensor
    if isinstance(mode, DiLoCo):  # compressed: an all-gather of the payloads; else an all-reduce, no flags
        payloads = sum(get_codec(mode.codec).payload_nbytes(s, torch.float32) for s in shapes) if mode.codec else 0
        return ((replicas - 1) * payloads if mode.codec else share * numel * 4) / mode.inner_steps, raw
    if isinstance(mode, LAG):  # a uint8 count per tensor, then the fired tensors' fp32 gradients
        return share * (lag_send_fraction * numel * 4 + len(shapes)), raw
    return raw, raw


def plan(model: Any, *, stages: int, replicas: int, tokens_per_step: int, microbatches: int = 1,
         forward_codec: Any = None, backward_codec: Any = None, tied_codec: Any = None, replica_sync: Any = "every-step",
         split_points: list[str] | None = None, hidden_bytes: int | None = None, seq_len: int | None = None,
         lag_send_fraction: float = 1.0, link_mbit: float | None = None, delay_ms: float = 0.0,
         replica_link_mbit: float | None = None, compute_s: float | list[float] | None = None) -> Plan:
    """The :class:`Plan` of one replica's optimizer step (see the module docstring for what is counted).

    ``tokens_per_step``: per replica, split into ``microbatches`` of ``seq_len``-token sequences (default: as long
    as the micro-batch, at most ``max_position_embeddings``). ``hidden_bytes``: fp32 bytes per token crossing a cut
    (default: traced; 4 x ``hidden_size`` when the forward cannot be traced). ``link_mbit`` / ``delay_ms``: every
    pipeline link; ``replica_link_mbit`` (default ``link_mbit``): each rank's link to its replicas; ``compute_s``:
    one micro-batch's forward per stage (a number or one per stage; backward twice that; default 0)."""
    module, config = load_model(model)
    partition = build_partition(module, stages, split_points)
    mode = resolve(replica_sync)
    tokens = tokens_per_step // microbatches
    seq = seq_len or min(tokens, getattr(config, "max_position_embeddings", None) or tokens)
    if tokens_per_step % microbatches or tokens % seq:
        raise ValueError(f"{tokens_per_step} tokens do not split into {microbatches} micro-batches of {seq} tokens")
    notes = []
    traced = hidden_bytes is None and config is not None
    crossings = crossing_tensors(module, partition.cut_points, tokens // seq, seq) if traced else None
    if crossings is None:
        if hidden_bytes is None and config is None:
            raise ValueError("give hidden_bytes (fp32 bytes per token at a cut) for a model without a HF config")
        width = (hidden_bytes or 4 * config.hidden_size) // 4
        crossings = [[((tokens, width), torch.float32, True)]] * (stages - 1)
        notes.append(f"cut inputs not traced: one hidden state of {width} values per token assumed at each cut")
    codecs = [get_codec(c) if c is not None else None for c in (forward_codec, backward_codec, tied_codec)]
    acts, fwds, bwds = activation_bytes(crossings, microbatches, codecs[0], codecs[1])
    raw_acts = activation_bytes(crossings, microbatches, "raw", "raw")[0]
    tied, raw_tied, tied_per_stage = tied_bytes(module, partition, codecs[2])
    shapes = stage_parameters(module, partition)
    per_rank = [replica_bytes(s, replicas, mode, lag_send_fraction) for s in shapes]
    if isinstance(mode, LAG):
        notes.append(f"LAG: {lag_send_fraction:.0%} of the gradients assumed sent (the skip rate is not known)")
    out = Plan(stages, replicas, microbatches, partition.cut_points,
               tuple(4 * sum(math.prod(x) for x in s) for s in shapes), acts, tied, sum(r[0] for r in per_rank),
               raw_acts, raw_tied, sum(r[1] for r in per_rank), tuple(fwds), tuple(bwds), mode.name, notes)
    if link_mbit is not None:  # the tied sum and the replica sync: the busiest rank's bytes over its link + a delay
        rate, replica_rate, delay = link_mbit / 8e-6, (replica_link_mbit or link_mbit) / 8e-6, delay_ms / 1e3
        fwd = list(compute_s) if isinstance(compute_s, (list, tuple)) else [compute_s or 0.0] * stages
        links = [Link(delay, f / rate, b / rate) for f, b in zip(fwds, bwds)]
        out.pipeline_s = step_time(one_f_one_b(stages, microbatches), fwd, [2 * f for f in fwd], links)
        out.tied_s = max(tied_per_stage) / rate + delay if tied else 0.0
        out.replica_s = max(r[0] for r in per_rank) / replica_rate + delay if replicas > 1 else 0.0
        out.step_time_s = out.pipeline_s + out.tied_s + out.replica_s
    return out


def main(argv: list[str] | None = None) -> Plan:
    """The command: print the plan's table (``--help`` lists the options)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-config", required=True, help=f"a config.json, or one of {', '.join(PRESETS)}")
    p.add_argument("--replica-sync", default="every-step", choices=["every-step", "lag", "diloco"])
    p.add_argument("--split-points", nargs="+")
    for flags, kind, default in (("stages replicas microbatches", int, 1), ("tokens", int, 2048),
                                 ("seq-len", int, None), ("inner-steps", int, 32), ("lag-send-fraction", float, 1.0),
                                 ("link-mbit replica-link-mbit compute-ms", float, None), ("delay-ms", float, 0.0),
                                 ("forward-codec backward-codec tied-codec sync-codec", str, None)):
        for flag in flags.split():
            p.add_argument(f"--{flag}", type=kind, default=default)
    a = p.parse_args(argv)
    if a.sync_codec and a.replica_sync != "diloco":
        p.error("--sync-codec compresses DiLoCo's pseudo-gradients: give --replica-sync diloco")
    sync = DiLoCo(inner_steps=a.inner_steps, codec=a.sync_codec) if a.replica_sync == "diloco" else a.replica_sync
    result = plan(a.hf_config, stages=a.stages, replicas=a.replicas, tokens_per_step=a.tokens,
                  microbatches=a.microbatches, forward_codec=a.forward_codec, backward_codec=a.backward_codec,
                  tied_codec=a.tied_codec, replica_sync=sync, split_points=a.split_points, seq_len=a.seq_len,
                  lag_send_fraction=a.lag_send_fraction, link_mbit=a.link_mbit, delay_ms=a.delay_ms,
                  replica_link_mbit=a.replica_link_mbit, compute_s=a.compute_ms and a.compute_ms / 1e3)
    print(result.table())
    return result


if __name__ == "__main__":
    main()
