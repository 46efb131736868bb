"""The planner's presets are the models as transformers 5 builds them, and the `fully_shard`
calls `shard-planner advise` prints apply to those models as printed.

Each model is built from its preset's recorded config on the meta device (no weights, no
download); its `named_parameters()` must be the preset's tensors, name for name and shape for
shape. The printed calls are then run with `model` bound to it and a `fully_shard` that
records, as FSDP does, the parameters each call takes (those no earlier call took).
"""

from __future__ import annotations

import math
import textwrap

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
fsdp_engine = pytest.importorskip("fsdp_engine")
device_mesh = pytest.importorskip("torch.distributed.device_mesh")

from shard_planner import fully_shard_calls, load_preset  # noqa: E402
from shard_planner._cli import main  # noqa: E402

CONFIGS = {
    "llama3-8b": "LlamaConfig",
    "llama3-70b": "LlamaConfig",
    "deepseek-v3-671b": "DeepseekV3Config",
    "gpt-oss-120b": "GptOssConfig",
    "qwen3-30b-a3b": "Qwen3MoeConfig",
    "qwen3-235b-a22b": "Qwen3MoeConfig",
}


def _meta_model(preset_name: str) -> torch.nn.Module:
    config = {k: v for k, v in load_preset(preset_name).config.items() if k != "note"}
    config_class = getattr(transformers, CONFIGS[preset_name])
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config_class(**config))


class _Recorder:
    """`fully_shard` as FSDP applies it: each call takes the parameters no earlier call took."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.taken: set[int] = set()
        self.groups: list[set[str]] = []
        self.kwargs: list[dict[str, object]] = []
        self.prefetch: dict[tuple[int, str], list[torch.nn.Module]] = {}

    def __call__(self, module: object, **kwargs: object) -> object:
        self.kwargs.append(kwargs)
        modules = module if isinstance(module, list) else [module]
        assert modules and all(isinstance(m, torch.nn.Module) for m in modules), module
        group = {
            id(p) for m in modules for p in m.parameters() if id(p) not in self.taken
        }  # fmt: skip
        self.taken |= group
        self.groups.append({self.names[i] for i in group})
        for m in modules:  # FSDPModule's prefetch setters, recording what they are given
            for kind in ("forward", "backward"):
                setter = f"set_modules_to_{kind}_prefetch"
                m.__dict__[setter] = lambda targets, m=m, kind=kind: self.prefetch.__setitem__(
                    (id(m), kind), list(targets)
                )
        return module


def _run(lines: list[str], model: torch.nn.Module) -> list[set[str]]:
    record = _Recorder(model)
    scope = {"model": model, "fully_shard": record, "experts_mesh": None, "dense_mesh": None}
    exec("\n".join(lines), scope)
    assert record.taken == set(record.names), "some parameters were in no group"
    return record.groups


@pytest.mark.parametrize("preset_name", sorted(CONFIGS))
def test_preset_is_the_model_transformers_builds(preset_name) -> None:
    model = _meta_model(preset_name)
    built = {name: tuple(p.shape) for name, p in model.named_parameters()}
    planned = {e.name: e.shape for g in load_preset(preset_name).groups for e in g.entries}
    assert sorted(set(built) - set(planned))[:5] == [], "built but not in the preset"
    assert sorted(set(planned) - set(built))[:5] == [], "in the preset but not built"
    wrong = [(n, built[n], planned[n]) for n in built if built[n] != planned[n]]
    assert wrong == [], wrong[:5]


@pytest.mark.parametrize("preset_name", sorted(CONFIGS))
def test_printed_calls_apply_verbatim_and_make_the_planned_groups(preset_name) -> None:
    model = _meta_model(preset_name)
    groups = load_preset(preset_name).groups
    made = _run(fully_shard_calls(groups), model)
    # The root's call takes nothing (every parameter is in a block or an end group).
    assert made[-1] == set() and sorted(map(sorted, made[:-1])) == sorted(
        sorted(e.name for e in g.entries) for g in groups
    )


@pytest.mark.parametrize(
    ("preset_name", "num_ranks", "uses_ep", "extra"),
    [("deepseek-v3-671b", 1024, True, []), ("gpt-oss-120b", 64, True, []),
     ("qwen3-30b-a3b", 64, True, []), ("qwen3-235b-a22b", 512, True, []),
     ("llama3-70b", 128, False, []), ("llama3-70b", 128, False, ["--prefetch", "2"]),
     ("gpt-oss-120b", 64, True, ["--prefetch", "2"])],
)  # fmt: skip
def test_advise_output_runs_as_printed(
    preset_name, num_ranks, uses_ep, extra, capsys, monkeypatch
) -> None:
    argv = ["advise", "--preset", preset_name, "--ranks", str(num_ranks), "--memory-gb", "80"]
    argv += ["--compute-bytes", "2", "--tokens-per-rank", "4096", "--top-k", "4", *extra]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # Fused experts (as transformers holds them) are searched with expert parallelism too;
    # the first plan of the large MoEs uses it (the tokens then go to their experts).
    first = next(line for line in out.splitlines() if line.startswith("| 1 |"))
    assert ("EP " in first) == uses_ep, first
    assert "the first plan as code" in out, out[-2000:]
    # The printed code: the indented lines under its heading (the notes follow it).
    after = out.split("the first plan as code", 1)[1].splitlines()[1:]
    block = []
    for line in after:
        if line and not line.startswith("    "):
            break
        block.append(line)
    code = textwrap.dedent("\n".join(block))
    model = _meta_model(preset_name)
    record = _Recorder(model)
    meshes: list[tuple[int, ...]] = []

    class FakeMesh:  # init_device_mesh's result where no process group exists
        def __init__(self, shape: tuple[int, ...], names: tuple[str, ...]) -> None:
            self.shape, self.names = shape, names

        def __getitem__(self, names: object) -> FakeMesh:
            return self

    def init_device_mesh(device: str, shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]):
        assert device == "cuda" and len(shape) == len(mesh_dim_names)
        meshes.append(shape)
        return FakeMesh(shape, mesh_dim_names)

    monkeypatch.setattr(device_mesh, "init_device_mesh", init_device_mesh)
    monkeypatch.setattr(fsdp_engine, "fully_shard", record)
    exec(code, {"model": model})
    assert record.taken == set(record.names), "some parameters were in no group"
    assert len(record.groups) > 3
    # The plan's settings reached every call: its mesh's shape, bf16 compute, fp32 reduce.
    assert math.prod(meshes[0]) == num_ranks
    assert all(kw["mp_policy"].param_dtype == torch.bfloat16 for kw in record.kwargs)
    assert all(kw["block_rows"] == 1 for kw in record.kwargs)
    # A plan that prefetches deeper than FSDP's default prints the settings as code: every
    # group but the root's is given the groups after it in the model's module order.
    prefetches = "set_modules_to_forward_prefetch" in code
    assert prefetches or not extra, code  # asked for 2 deep: printed
    if prefetches:
        forward = {k[0]: v for k, v in record.prefetch.items() if k[1] == "forward"}
        assert len(forward) == len(record.groups) - 1, (len(forward), len(record.groups))
        firsts = [targets[0] for targets in forward.values() if targets]
        assert firsts and all(isinstance(m, torch.nn.Module) for m in firsts)
