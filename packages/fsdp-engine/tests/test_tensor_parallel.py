"""fully_shard over tensor- and expert-parallel DTensors: 2-D and 3-D meshes on gloo ranks."""

import pytest
import torch

# torch's test Transformer (torch.testing._internal) imports expecttest, a test-only package
# that a machine with torch alone may lack.
pytest.importorskip("expecttest", reason="torch's test models need expecttest")
import tp_cases as cases

# torch 2.10's DTensor loses a RowwiseParallel embedding's MaskPartial mask between calls
# ("assert self.mask_buffer.data is not None" in the embedding's reduce), with tensor
# parallelism alone, no FSDP; 2.11 and later do not (measured on 2.10.0, 2.11.0, 2.13.0). The
# torch test Transformer parallelizes its embeddings that way.
_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
sound_embedding_tp = pytest.mark.skipif(
    _TORCH < (2, 11), reason="torch 2.10's RowwiseParallel embedding loses its mask buffer"
)


@sound_embedding_tp
@pytest.mark.parametrize("seq_parallel", [False, True])
@pytest.mark.parametrize("precision", ["fp64", "fp32", "bf16"])
def test_dp2_tp2_matches_one_process_and_fsdp2(pools, seq_parallel, precision) -> None:
    result = pools[4].run(cases.check_training, (2, 2), seq_parallel, precision)[0]
    print(f"dp2 x tp2 {precision} sp={seq_parallel}: {result['record']}")


@sound_embedding_tp
@pytest.mark.parametrize(("world", "shape"), [(4, (2, 2)), (3, (1, 3))], ids=["dp2xtp2", "dp1xtp3"])
def test_cpu_offload_under_tensor_parallel(pools, world, shape) -> None:
    # CPUOffloadPolicy on both engines over TP DTensors, with our clip_grad_norm_.
    result = pools[world].run(cases.check_training, shape, False, "fp64+offload")[0]
    print(f"{shape} fp64 offloaded: {result['record']}")


@sound_embedding_tp
@pytest.mark.parametrize(
    ("world", "shape"),
    [(4, (1, 4)), (4, (2, 1, 2)), (3, (3, 1)), (3, (1, 3)), (2, (1, 2)), (1, (1, 1))],
    ids=["dp1xtp4", "hsdp2x1xtp2", "dp3xtp1", "dp1xtp3", "dp1xtp2", "dp1xtp1"],
)
def test_other_meshes_match_one_process_and_fsdp2(pools, world, shape) -> None:
    result = pools[world].run(cases.check_training, shape, True, "fp64")[0]
    print(f"{shape} fp64: {result['record']}")


@sound_embedding_tp
@pytest.mark.parametrize(("world", "shape"), [(4, (2, 2)), (3, (1, 3))])
def test_meta_init_equals_one_process(pools, world, shape) -> None:
    pools[world].run(cases.check_meta_init, shape)


@sound_embedding_tp
@pytest.mark.parametrize(
    ("save", "load"), [((2, 2), (4, 1)), ((4, 1), (2, 2))], ids=["2x2->4x1", "4x1->2x2"]
)
def test_checkpoint_reshards_across_meshes(pools, tmp_path, save, load) -> None:
    pools[4].run(cases.check_checkpoint, str(tmp_path / "dcp"), save, load)


@pytest.mark.parametrize(("kind", "num_experts"), [("fused", 4), ("separate", 4), ("fused", 3)])
def test_expert_parallel_matches_one_process(pools, kind, num_experts) -> None:
    # 3 fused experts over ep=2: 2 and 1 per ep rank, sharded over dp as RaggedShard pieces.
    pools[4].run(cases.check_expert_parallel, kind, num_experts)


@pytest.mark.parametrize("world", [2, 4])
def test_bad_input(pools, world) -> None:
    pools[world].run(cases.check_bad_input)
