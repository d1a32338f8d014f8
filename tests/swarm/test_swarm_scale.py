"""The churn benchmark's short variant (benchmarks/swarm_scale.py), on the session's bootstrap peer: 8
servers of a model of their own (half of them --num-blocks), 2 clients generating without pause, 3
servers SIGKILLed and replaced by new --num-blocks servers. Every token equals transformers', and no
generation fails. Its figures (route changes, the longest time a block went without a live server,
DHT operations, memory) are printed, never asserted."""

from benchmarks.swarm_scale import ChurnConfig, format_report, run_churn


def test_a_swarm_under_churn_gives_exact_tokens(swarm, fresh_model, reference_model, tmp_path):
    # no final kill of a whole range here: tests/swarm/test_rebalancing.py does that
    config = ChurnConfig(servers=8, clients=2, rounds=3, kill_every_s=4.0, settle_s=6.0, new_tokens=12,
                         num_prompts=4, range_kill=False)
    report = run_churn(swarm, fresh_model, reference_model, config, tmp_path)
    print("\n" + format_report(report, config))
    assert report.kills == 3
    assert not report.failed, report.failed
    assert report.tokens_wrong == 0 and report.tokens_checked >= config.clients * config.new_tokens
