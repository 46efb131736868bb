"""Train a small Llama-style decoder on Shakespeare with fsdp_engine or torch FSDP2.

Run it under torchrun (one process per rank; multi-node works unchanged):

    python -m torch.distributed.run --nproc-per-node 2 examples/train.py --engine ours

or let it start its ranks itself on this machine (gloo on CPU):

    python examples/train.py --nproc 2 --engine fsdp2 --steps 100

`--tp N` adds tensor parallelism, `--moe E --ep N` expert parallelism, and `--pp N` pipeline
parallelism (each pipeline rank one stage of blocks, sharded over its data-parallel ranks,
driven by torch's `--pp-schedule`), each under fully_shard.

Every rank draws its share of the same global batch for a step, so the data (and the loss
curve, up to floating-point summation order) does not depend on the engine or the world size.
Rank 0 shows a progress bar, writes `<out>/<engine>.json` (losses, timings, memory, copies,
padding) and prints 300 characters sampled from the trained model.

What you adapt comes first: `build` (the model, sharded block by block and then the root),
`make_optimizer` and `train` (the step). Measurement and checkpoints follow; the command line
and the data are `train_setup.py`.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import alternate
import checkpoints
from model import Config, Decoder, loss_fn
from parallel import expert_parallel, tensor_parallel
from pipeline import DecoderStage, decoder_stage, pipeline_schedule
from profiling import engine_copies, gathered_bytes, peak_live_bytes
from train_setup import Text, UsageError, check_args, parse_args

from dbuffer import BlockFloat8
from fsdp_engine import clip_grad_norm_

MEASURE_STEPS = (3, 4, 5)  # measured (peak memory, copies, gathered bytes), left out of timings


# -- model and engine --------------------------------------------------------------------------


def build(args: argparse.Namespace, vocab: int, device: torch.device) -> nn.Module:
    """The decoder, with each block and then the root sharded by the chosen engine.

    With `--pp`: this rank's pipeline stage of it (`pipeline.decoder_stage`), sharded over the
    stage's data-parallel ranks.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    cfg = Config(
        vocab=vocab,
        dim=args.dim,
        num_heads=args.heads,
        num_layers=args.layers,
        hidden=int(8 * args.dim / 3 + 63) // 64 * 64,
        num_experts=args.moe,
    )
    torch.manual_seed(args.seed)
    model = Decoder(cfg).to(device)
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    experts_mesh = None
    if args.tp > 1:  # (dp, tp): tensor parallel first, then fully_shard over dp
        grid = init_device_mesh(
            device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp")
        )
        tensor_parallel(model, grid["tp"])
        mesh = grid["dp"]
    if args.pp > 1:  # (pp, dp): this rank's stage, sharded over dp
        grid = init_device_mesh(
            device.type, (args.pp, world // args.pp), mesh_dim_names=("pp", "dp")
        )
        args.pp_mesh = grid["pp"]
        model = decoder_stage(model, grid["pp"].get_local_rank(), args.pp)  # type: ignore[assignment]
        mesh = grid["dp"]
    if args.ep > 1:  # experts over (dp, ep); everything else over all ranks
        grid = init_device_mesh(
            device.type, (world // args.ep, args.ep), mesh_dim_names=("dp", "ep")
        )
        expert_parallel(model, grid["ep"])
        experts_mesh = grid["dp"]
    mp = MixedPrecisionPolicy()
    if args.mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    import torch.distributed.fsdp as torch_fsdp

    import fsdp_engine

    # Either engine's, with FSDP2's signature.
    fully_shard: Callable[..., Any] = (
        fsdp_engine.fully_shard if args.engine == "ours" else torch_fsdp.fully_shard
    )
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp}
    if args.optimizer == "adamw8bit":  # whole 32 x 32 quantization blocks on every rank
        # (for the matrices that get 8-bit state: 2-D, at least AdamW8bit's min_8bit_numel)
        kwargs["block_rows"] = lambda fqn, p: 32 if p.dim() == 2 and p.numel() >= 4096 else 1
    if args.gather == "fp8":
        kwargs["gather_format"] = fp8_gather_format
    layers = cast(Any, model).layers  # a ModuleDict of a pipeline stage's blocks, or a ModuleList
    for layer in layers.values() if args.pp > 1 else layers:
        if experts_mesh is not None:
            experts = fully_shard(layer.mlp.experts, **{**kwargs, "mesh": experts_mesh})
            # An expert's gradient sums its whole ep group's: divided by every rank, it is
            # the batch mean (as torchtitan sets it).
            experts.set_gradient_divide_factor(float(world))
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def fp8_gather_format(fqn: str, param: nn.Parameter) -> BlockFloat8 | None:
    """`--gather fp8`: each matrix as fp8 codes with one scale per 32 x 128 block.

    A matrix whose rows are not a multiple of 32 (the embedding of 65 characters) is one
    block of all its rows, so that no shard boundary cuts a block.
    """
    if param.dim() != 2:
        return None  # norms: gathered as usual
    rows = 32 if param.shape[0] % 32 == 0 else param.shape[0]
    return BlockFloat8(block=(rows, 128))


def make_optimizer(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW (torch's, or ours over flat runs), AdamW8bit, or Muon with AdamW on the rest.

    "flat-adamw" is torch's AdamW arithmetic (the same results) stepping each run of adjacent
    parameter pieces as one tensor: on our engine a few per group, so the step's host work
    does not grow with the number of parameters. For Muon, embeddings, the output head and
    norms are not hidden matrices (Muon's update suits only those), so they go to Muon's AdamW
    groups; "match_rms_adamw" scales Muon's update to AdamW's RMS, so one learning rate serves
    both.
    """
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, foreach=True)
    from ragged_optimizers import AdamW, AdamW8bit, Muon

    if name == "flat-adamw":
        return AdamW(model.parameters(), lr=lr, weight_decay=0.1)

    if name == "adamw8bit":
        return AdamW8bit(model.named_parameters(), lr=lr, weight_decay=0.1)
    named = list(model.named_parameters())
    hidden = [(n, p) for n, p in named if n.startswith("layers.") and p.dim() >= 2]
    rest = [(n, p) for n, p in named if not (n.startswith("layers.") and p.dim() >= 2)]
    return Muon(
        [{"params": hidden}, {"params": rest, "use_muon": False}],
        lr=lr,
        weight_decay=0.1,
        adjust_lr="match_rms_adamw",
        adamw_lr=lr,
        adamw_betas=(0.9, 0.95),
        adamw_eps=1e-8,
        adamw_weight_decay=0.1,
    )


def padding_bytes(model: nn.Module, engine: str) -> int:
    """Bytes of padding in the sharded parameters, over all ranks."""
    if engine == "ours":
        from fsdp_engine import sharding_summary

        return sum(g.padding_bytes for g in sharding_summary(model))
    from shard_planner import TensorSpec, fsdp2_padding

    world = dist.get_world_size()  # FSDP2: every parameter padded to a multiple of W rows
    return sum(
        fsdp2_padding([TensorSpec.from_shape(name, tuple(p.shape))], world) * p.element_size()
        for name, p in model.named_parameters()
    )


# -- training -----------------------------------------------------------------------------------


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Trains on this rank; returns the run's record (the same on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(args.device, rank)
    text = Text(args.data)
    model = build(args, len(text.chars), device)  # each block, then the root, sharded
    runner = Runner(model, args, device, len(text.chars))
    opt = make_optimizer(args.optimizer, model, args.lr)
    settings = checkpoints.run_settings(args, len(text.chars), args.data)
    start = checkpoints.load(args.resume_from, model, opt) if args.resume_from else 0

    def my_rows(step: int) -> torch.Tensor:  # this rank's share of the step's global batch
        batch = text.batch("train", args.seed, step, args.global_batch, args.seq_len)
        return my_share(batch, args).to(device)

    def step_fn(step: int) -> float:
        loss = runner.loss_and_backward(my_rows(step))
        # torch's clip, also over several meshes (TP) and every pipeline stage's gradients
        clip_grad_norm_(model.parameters(), 1.0, pp_mesh=args.pp_mesh)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss)
        return loss.item() / world

    def lead_in(step: int) -> None:
        # Gradients computed and dropped (the step itself computes them again): what the
        # engine allocates for them, and frees in the measured step, is then counted.
        runner.loss_and_backward(my_rows(step))
        opt.zero_grad()

    log = _Log(args, rank, start, device)
    for step in range(start, args.steps):
        checkpoints.fault_before_step(step + 1)
        log.step(step, step_fn, lead_in)
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            log.record["val"].append((done, evaluate(runner, text, args, device)))
        every = args.checkpoint_every
        if args.checkpoint is not None and (done == args.steps or (every and done % every == 0)):
            checkpoints.save(args.checkpoint, done, model, opt, settings, args.keep_checkpoints)
    log.close()
    record = log.finish(world, args.global_batch * args.seq_len)
    record.update(
        sample=sample(runner, text, args.sample_chars, device, args.seq_len),
        padding_bytes=runner.over_stages(padding_bytes(model, args.engine)),
        unigram_entropy=text.unigram_entropy(),
        num_params=runner.over_stages(sum(p.numel() for p in model.parameters())),
    )
    return record


def time_alternately(args: argparse.Namespace) -> dict[str, Any]:
    """Step times of both engines, alternated in one run (`alternate.py`)."""
    device = _device(args.device, dist.get_rank())
    text = Text(args.data)
    vocab = len(text.chars)

    def setup(setup_args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, Runner]:
        model = build(setup_args, vocab, device)
        return (
            model,
            make_optimizer(setup_args.optimizer, model, args.lr),
            Runner(model, setup_args, device, vocab),
        )

    def batch(step: int) -> torch.Tensor:
        rows = text.batch("train", args.seed, step, args.global_batch, args.seq_len)
        return my_share(rows, args).to(device)

    return alternate.time_setups(args, setup, batch, device)


class Runner:
    """A forward (and backward) of the model, or of the pipeline when each rank is a stage.

    Every method is called by every rank; the results are the same on all ranks of a
    data-parallel replica (the last stage's, sent to the others).
    """

    def __init__(
        self, model: nn.Module, args: argparse.Namespace, device: torch.device, vocab: int
    ) -> None:
        self.model, self.pp_mesh, self.vocab = model, args.pp_mesh, vocab
        self.schedule = None
        self.batch_rows = 0  # a pipelined forward's rows: the training batch's per replica
        self.first = self.last = True
        if self.pp_mesh is not None:
            self.schedule = pipeline_schedule(
                cast(DecoderStage, model),
                self.pp_mesh,
                device,
                args.pp_schedule,
                args.microbatches,
                loss_fn,
            )
            self.batch_rows = args.global_batch // (dist.get_world_size() // args.pp)
            self.first = self.pp_mesh.get_local_rank() == 0
            self.last = self.pp_mesh.get_local_rank() == self.pp_mesh.size() - 1

    def loss_and_backward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The loss of `tokens` (next-token), its gradients accumulated into the parameters."""
        if self.schedule is None:
            loss = loss_fn(self.model(tokens), tokens)
            loss.backward()  # type: ignore[no-untyped-call]
            return loss.detach().float()
        losses: list[torch.Tensor] = []
        self.schedule.step(*self._inputs(tokens), target=self._target(tokens), losses=losses)
        return self._from_last_stage(losses, tokens.device)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """The loss of `tokens`, forward only."""
        if self.schedule is None:
            with torch.no_grad():
                return loss_fn(self.model(tokens), tokens).float()
        losses: list[torch.Tensor] = []
        with torch.no_grad():
            self.schedule.eval(*self._inputs(tokens), target=self._target(tokens), losses=losses)
        return self._from_last_stage(losses, tokens.device)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The logits of `tokens` (on every pipeline rank), forward only."""
        if self.schedule is None:
            with torch.no_grad():
                logits: torch.Tensor = self.model(tokens)
                return logits
        assert self.pp_mesh is not None
        with torch.no_grad():
            out: torch.Tensor = self.schedule.eval(
                *self._inputs(tokens), target=self._target(tokens)
            )
        if not self.last:
            out = torch.empty(*tokens.shape, self.vocab, device=tokens.device)
        dist.broadcast(out, self._last_rank(), group=self.pp_mesh.get_group())
        return out

    def over_stages(self, value: int) -> int:
        """A per-stage count summed over the pipeline stages (the whole model's)."""
        if self.pp_mesh is None:
            return value
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total, group=self.pp_mesh.get_group())
        return int(total.item())

    def _inputs(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (tokens,) if self.first else ()

    def _target(self, tokens: torch.Tensor) -> torch.Tensor | None:
        return tokens if self.last else None

    def _last_rank(self) -> int:
        assert self.pp_mesh is not None
        return dist.get_global_rank(self.pp_mesh.get_group(), self.pp_mesh.size() - 1)

    def _from_last_stage(self, losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        # The micro-batches' mean (the schedule scales their gradients so), sent to the stages.
        assert self.pp_mesh is not None
        loss = torch.stack(losses).mean().float() if self.last else torch.zeros((), device=device)
        dist.broadcast(loss, self._last_rank(), group=self.pp_mesh.get_group())
        return loss.detach()


def my_share(batch: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """This rank's rows: the tensor-parallel ranks (or pipeline stages) of a replica share them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    replica, num_replicas = rank // args.tp, world // args.tp
    if args.pp > 1:  # ranks are (pp, dp): the replica is the data-parallel index
        replica, num_replicas = rank % (world // args.pp), world // args.pp
    per_replica = batch.shape[0] // num_replicas
    return batch[replica * per_replica : (replica + 1) * per_replica]


def evaluate(runner: Runner, text: Text, args: argparse.Namespace, device: torch.device) -> float:
    """Mean validation loss over 4 fixed global batches."""
    world = dist.get_world_size()
    losses = []
    for index in range(4):
        batch = text.batch("val", args.seed + 1, index, args.global_batch, args.seq_len)
        losses.append(runner.loss(my_share(batch, args).to(device)))
    value = torch.stack(losses).mean().float()
    dist.all_reduce(value)
    return value.item() / world


def sample(runner: Runner, text: Text, num_chars: int, device: torch.device, seq: int) -> str:
    """Characters sampled at temperature 0.8 (every rank runs it: forward gathers need all).

    Through a pipeline every forward has the training batch's shape (its stages were set up
    for it): the context, right-padded (causal attention: the padding changes no earlier
    position), fills every row.
    """
    gen = torch.Generator().manual_seed(1234)
    ids = [text.chars.index("\n")]
    rows = runner.batch_rows
    for _ in range(num_chars):
        context = ids[-(seq + 1) :] if rows else ids[-seq:]
        if rows:
            padded = torch.tensor(context + [0] * (seq + 1 - len(context)), device=device)
            logits = runner.logits(padded.expand(rows, -1).contiguous())[0, len(context) - 1]
        else:
            logits = runner.logits(torch.tensor([context], device=device))[0, -1]
        logits = logits.float().cpu() / 0.8
        ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=gen)))
    return text.decode(ids[1:])


# -- measurement ------------------------------------------------------------------------------


def _device(kind: str, rank: int) -> torch.device:
    if kind != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    return device


class _Log:
    """The run's record and rank 0's progress bar.

    Losses, step times (the slowest rank's), and the peak memory and copy kernels of two
    profiled steps (left out of the timings).
    """

    def __init__(
        self, args: argparse.Namespace, rank: int, start: int, device: torch.device
    ) -> None:
        self.start, self.device = start, device
        self.tokens_per_step = args.global_batch * args.seq_len
        self.record: dict[str, Any] = {
            "train": [],
            "val": [],
            "step_s": [],
            "engine": args.engine,
            "optimizer": args.optimizer,
            "gather": args.gather,
        }
        self.every_step_s: list[float] = []  # also the warm-up and profiled steps
        self.bar = _progress(rank, start, args.steps)

    def step(
        self, step: int, step_fn: Callable[[int], float], lead_in: Callable[[int], None]
    ) -> None:
        """Runs `step_fn(step)`, timed; the steps in MEASURE_STEPS also measured."""
        measure: Callable[[Callable[[], object]], Any] | None = None
        if step - self.start == MEASURE_STEPS[0]:
            measure = functools.partial(
                peak_live_bytes, include_live=True, lead_in=functools.partial(lead_in, step)
            )
        elif step - self.start == MEASURE_STEPS[1]:
            measure = functools.partial(engine_copies, by_range=True)
        elif step - self.start == MEASURE_STEPS[2]:
            measure = gathered_bytes
        t0 = time.perf_counter()
        if measure is None:
            loss = step_fn(step)
        else:
            box: list[float] = []
            result = measure(lambda: box.append(step_fn(step)))
            loss = box[0]
            if isinstance(measure, functools.partial) and measure.func is engine_copies:
                self.record["copies"] = {
                    k: {"kernels": c.kernels, "bytes": c.bytes} for k, c in result.items()
                }
            elif measure is gathered_bytes:
                self.record["gathered_bytes"] = result
            else:
                self.record["peak_live_bytes"] = result
        elapsed = torch.tensor(time.perf_counter() - t0, device=self.device)  # NCCL: on the GPU
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        self.every_step_s.append(elapsed.item())
        if measure is None and step - self.start > 1:  # the first steps warm up
            self.record["step_s"].append(elapsed.item())
        self.record["train"].append((step + 1, loss))
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{loss:.3f}",
                tok_s=f"{self.tokens_per_step / elapsed.item():,.0f}",
                mem=_memory(self.device),
            )
            self.bar.update(1)

    def close(self) -> None:
        """Closes the progress bar."""
        if self.bar is not None:
            self.bar.close()

    def finish(self, world: int, tokens_per_step: int) -> dict[str, Any]:
        """The record with its throughput figures."""
        record = self.record
        # Too short a run for steady-state timings (warm-up and profiled steps excluded):
        # time every step instead, and say so.
        record["timed_every_step"] = not record["step_s"]
        step_s = statistics.median(record["step_s"] or self.every_step_s or [float("inf")])
        record.update(world=world, tokens_per_s=tokens_per_step / step_s, median_step_s=step_s)
        return record


def _progress(rank: int, start: int, steps: int) -> Any:
    if rank != 0:
        return None
    import threading

    from tqdm import tqdm

    # tqdm's default lock holds a multiprocessing semaphore; a spawned rank ends by os._exit
    # (below), which leaves it to the resource tracker, and that warns of a leak at exit.
    tqdm.set_lock(threading.RLock())
    return tqdm(total=steps, initial=start, unit="step", dynamic_ncols=True, file=sys.stdout)


def _memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**20:.0f}MiB"
    import resource

    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f}MiB rss"


# -- entry points -------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> None:
    """One rank's work (torch.distributed is initialized)."""
    import ragged_placement  # noqa: F401  (RaggedShard support in DTensor, for DCP and ops)

    if args.alternate:
        timing = time_alternately(args)
        if dist.get_rank() == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "timing.json").write_text(json.dumps(timing, indent=1))
            print(alternate.timing_table(timing))
        gc.collect()  # as below
        dist.barrier()
        return
    record = train(args)
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.engine}.json").write_text(json.dumps(record, indent=1))
        final_val = record["val"][-1][1]
        print(
            f"{args.engine}: {record['num_params']:,} params, W={record['world']}, "
            f"final train loss {record['train'][-1][1]:.4f}, val loss {final_val:.4f} "
            f"(unigram entropy {record['unigram_entropy']:.4f}), "
            f"{record['median_step_s'] * 1e3:.0f} ms/step in this run alone "
            f"({record['tokens_per_s']:,.0f} tok/s; --alternate N compares engines)"
            + (" (short run: warm-up steps included)" if record["timed_every_step"] else "")
        )
        print(f"--- sample ({args.engine}) ---\n{record['sample']}\n---")
    # The model is cyclic garbage (modules and their hooks) that holds the process group and
    # tensors gloo's worker threads touched last. Left to interpreter shutdown, freeing those
    # tensors takes the GIL while the interpreter is being torn down: SIGABRT ("terminate called
    # without an active exception"), now and then. Free them now, and let no rank go on (or
    # leave) while another still talks to it.
    gc.collect()
    dist.barrier()


def _run_then_shut_down(args: argparse.Namespace) -> int:
    """Runs this rank; 2 (the message printed once) for a checkpoint found damaged."""
    try:
        run(args)
        return 0
    except checkpoints.CheckpointError as exc:  # raised on every rank alike
        if dist.get_rank() == 0:
            print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, init_file: str, args: argparse.Namespace) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    status = _run_then_shut_down(args)
    # A spawned rank has nothing left to tear down; skipping interpreter shutdown also skips
    # any gloo worker-thread cleanup that could still abort it (see above).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    """Checks the input, then runs under torchrun or starts `--nproc` local ranks."""
    args = parse_args(argv)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if launched else max(args.nproc, 1)
    try:
        check_args(args, world)
    except UsageError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    if launched:
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend)
        return _run_then_shut_down(args)
    import tempfile

    from torch.multiprocessing.spawn import ProcessExitedException, spawn

    with tempfile.TemporaryDirectory() as tmp:
        try:
            spawn(_spawned, args=(world, f"{tmp}/rendezvous", args), nprocs=world)
        except ProcessExitedException as exc:
            if exc.exit_code == 2:  # a damaged checkpoint, already reported by rank 0
                return 2
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
