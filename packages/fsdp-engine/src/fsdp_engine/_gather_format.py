"""Which parameters of a group are all-gathered in a block-scaled fp8 wire format.

`fully_shard(..., gather_format=BlockFloat8(block=(rows, cols)))` gathers every parameter of
2 or more dims as fp8 codes with one fp32 scale per block, dequantized into `param_dtype` for
compute (dbuffer's `_wire.py`); parameters of fewer dims are gathered as usual. A function of
(fqn, param) chooses per parameter instead (a BlockFloat8, or None for the usual gather).
Gradients stay in `reduce_dtype` and the optimizer updates the full-precision shards.

A parameter gathered in a block format gets `block_rows` = the block's rows unless the call
gave `block_rows`: shards then hold whole blocks, which makes each rank's quantization of its
own blocks the one-process quantization of the tensor. The parameters of one format share a
DBuffer (formats, like dtypes and meshes, never mix within one).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from dbuffer import BlockFloat8

GatherFormatArg = BlockFloat8 | Callable[[str, nn.Parameter], BlockFloat8 | None] | None


def resolve_gather_formats(
    gather_format: GatherFormatArg,
    names: dict[nn.Parameter, str],
    rows: dict[str, int],
    *,
    rows_given: bool,
) -> dict[str, BlockFloat8]:
    """Each parameter's gather format by FQN (absent: the usual gather); sets its block rows.

    Args:
        gather_format: `fully_shard`'s argument.
        names: The group's parameters and their FQNs.
        rows: Block rows by FQN (updated for the parameters in a format, unless given).
        rows_given: Whether the call gave `block_rows`.

    Raises:
        TypeError: `gather_format` (or what its function returned for a parameter) is not a
            BlockFloat8 / None, naming the parameter.
    """
    if gather_format is None:
        return {}
    if isinstance(gather_format, BlockFloat8):
        formats = {fqn: gather_format for param, fqn in names.items() if param.dim() >= 2}
    elif callable(gather_format):
        formats = {}
        for param, fqn in names.items():
            chosen: object = gather_format(fqn, param)  # user code: check what came back
            if chosen is not None and not isinstance(chosen, BlockFloat8):
                raise TypeError(
                    f"gather_format for {fqn!r} must be a BlockFloat8 or None, got {chosen!r}"
                )
            if chosen is not None:
                formats[fqn] = chosen
    else:
        raise TypeError(
            f"gather_format must be a BlockFloat8, a function of (fqn, param) returning one "
            f"or None, or None; got {type(gather_format).__name__}"
        )
    if not rows_given:
        for fqn, fmt in formats.items():
            rows[fqn] = fmt.block[0]
    return formats
