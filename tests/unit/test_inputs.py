"""Samples and tokens inferred from the root module's call (collectors/inputs.py): what the throughput cards show
when a framework never calls dtprof.annotate."""
import torch

from dtprof.collectors import inputs


def test_a_framework_batch_list_gives_its_batch_dimension():
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    assert inputs.batch_counts(([x, y], 0), {}) == (8, None)           # Lightning: model(batch, batch_idx)


def test_token_ids_give_samples_and_tokens():
    ids = torch.randint(0, 100, (4, 16))
    assert inputs.batch_counts((), {"input_ids": ids, "labels": ids}) == (4, 64)     # Hugging Face: keywords
    assert inputs.batch_counts((ids,), None) == (4, 64)


def test_the_walk_is_depth_first_and_skips_scalars():
    scalar, first, second = torch.tensor(1.0), torch.randn(5, 2), torch.randn(7, 2)
    assert inputs.batch_counts(((scalar, {"a": first}, second),), {}) == (5, None)


def test_the_walk_stops_four_levels_down():
    t = torch.randn(3, 2)
    # (args, kwargs) -> args -> two lists -> t: four levels; a third list puts it out of reach
    assert inputs.batch_counts(([[t]],), {}) == (3, None)
    assert inputs.batch_counts(([[[t]]],), {}) is None
    assert inputs.batch_counts(("no tensor", 1), {}) is None
