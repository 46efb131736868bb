"""The engine applies a plan that shard_planner.advise prints and holds what it estimates."""

import plan_cases as cases


def test_engine_follows_advised_layouts_byte_for_byte(pools) -> None:
    for result in pools[4].run(cases.check_engine_follows_advised_plans)[0]:
        print(result)


def test_engine_follows_a_dense_sub_mesh_plan_byte_for_byte(pools) -> None:
    print(pools[4].run(cases.check_engine_follows_a_dense_sub_mesh_plan)[0])
