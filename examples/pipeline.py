"""Pipeline parallelism for the example decoder: one stage of blocks per pipeline rank.

`decoder_stage(model, index, num_stages)` keeps the blocks of stage `index` (the first stage
also the embedding, the last one the final norm and the head); the others are dropped. Blocks
keep their names (`layers.5` stays `layers.5`), so a checkpoint saved at one pipeline size
loads at another. `pipeline_schedule` wraps the stage, sharded by `fully_shard` over its
data-parallel mesh, in one of torch's schedules.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from model import Decoder
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
}


class DecoderStage(nn.Module):
    """Some consecutive blocks of a Decoder, with its embedding first or its head last."""

    def __init__(self, model: Decoder, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = model.embed if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in blocks})
        self.norm = model.norm if last else None
        self.head = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits out."""
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def decoder_stage(model: Decoder, index: int, num_stages: int) -> DecoderStage:
    """Stage `index` of `num_stages`: an even share of the blocks (the first stages one more)."""
    num_blocks = len(model.layers)
    if not 1 <= num_stages <= num_blocks:
        raise ValueError(
            f"{num_stages} stages need 1 to {num_blocks} blocks each, got a model of {num_blocks}"
        )
    per, extra = divmod(num_blocks, num_stages)
    start = index * per + min(index, extra)
    blocks = range(start, start + per + (index < extra))
    return DecoderStage(model, blocks, index == 0, index == num_stages - 1)


def pipeline_schedule(
    stage: DecoderStage,
    pp_mesh: DeviceMesh,
    device: torch.device,
    schedule: str,
    num_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> PipelineScheduleSingle:
    """`stage` (already sharded) on this pipeline rank, in the named schedule."""
    pipe_stage = PipelineStage(
        stage, pp_mesh.get_local_rank(), pp_mesh.size(), device, group=pp_mesh.get_group()
    )
    return SCHEDULES[schedule](pipe_stage, num_microbatches, loss_fn=loss_fn)
