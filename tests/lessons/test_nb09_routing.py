"""Notebook 09's sys512 panel: why its TTFT p99 bars are all equal, and what the notebook shows
instead."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def test_sys512_p99_is_the_cold_prefill_every_run_pays_and_the_mean_counts_them():
    from kvlab.built.nb09 import sweep
    from kvlab.lessons.nb09_routing import fig_policies, sys512_workload

    df = sweep(sys512_workload(seed=0), (1, 4), ("round_robin", "kv_aware"), num_blocks=96)
    # p99 of 16 requests is the slowest one: a cold prefill of the whole prompt, priced alike on the
    # modelled clock
    assert df.ttft_p99.round(9).nunique() == 1 and df.slowest_cold.all()
    one, four = (
        df[(df.replicas == 1)].iloc[0],
        df[(df.replicas == 4) & (df.policy == "round_robin")].iloc[0],
    )
    # round robin computes the prefix once per replica
    assert one.cold_prefills == 1 and four.cold_prefills == 4
    assert four.ttft_mean > one.ttft_mean
    fig = fig_policies(df, "sys512", ttft="ttft_mean")
    assert fig.axes[1].get_title() == "mean TTFT" and "mean TTFT" in fig.axes[1].get_ylabel()
    plt.close(fig)
