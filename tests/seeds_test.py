"""The named seed streams of `impala_tf.utils.seeds`."""

from __future__ import annotations

from impala_tf.utils import seeds


def test_env_and_sampler_seeds_follow_rllibs_scheme():
    assert seeds.env_seed(7, 2, 3) == 7 + 2 * 1000 + 3
    assert seeds.sampler_seeds(7, 2, ["default_policy"], False) == {"default_policy": 2007}
    many = seeds.sampler_seeds(7, 2, ["p1", "p0"], True)
    assert many == {"p0": 2007 + 7919, "p1": 2007 + 2 * 7919}
    assert seeds.replay_seed(7, 1, 2) == 7 + 10_000 + 1 + 2000


def test_each_stream_draws_its_own_seed_and_an_unseeded_run_gets_none():
    drawn = {
        seeds.stream_seed(0, stream, key, *more)
        for stream in seeds.Stream
        for key in (0, 1)
        for more in ((), (1,))
    }
    assert len(drawn) == len(seeds.Stream) * 4
    assert seeds.stream_seed(0, seeds.Stream.EVALUATION, 3) == seeds.derived_seed(0, 3, 1)
    for value in (
        seeds.env_seed(None, 1, 0),
        seeds.replay_seed(None, 0, 0),
        seeds.stream_seed(None, seeds.Stream.RESTARTED_ACTOR, 1, 0),
        *seeds.sampler_seeds(None, 1, ["p0", "p1"], True).values(),
    ):
        assert value is None
