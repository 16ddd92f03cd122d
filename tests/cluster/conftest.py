"""Ray starts once per test session (about 20 s on 2 cores), shared by every file that uses real
actors."""

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """The ``ray`` module with a local instance running (Ray is in the dev extra: a start that fails
    fails)."""
    ray = pytest.importorskip(
        "ray", reason="Ray is the optional extra kvlab[cluster]: pip install -e .[cluster]"
    )
    from kvlab.cluster import start_ray

    start_ray(num_cpus=2)
    try:
        yield ray
    finally:
        ray.shutdown()

