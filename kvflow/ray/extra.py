"""Ray is an optional extra: it is imported here, only when asked for, and its absence named with the extra that
installs it."""
from __future__ import annotations

EXTRA_HINT = "pip install 'kvflow[ray]'"


def require_ray():
    """The `ray` module with Ray Data, or an ImportError saying which extra installs it."""
    try:
        import ray
        import ray.data  # noqa: F401  (Ray Data comes with ray[data], not with the bare ray wheel)
    except ImportError as e:
        raise ImportError(f"running on Ray needs Ray and Ray Data, which are not installed: {EXTRA_HINT} "
                          f"(import failed: {e})") from e
    return ray
