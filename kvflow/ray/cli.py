"""`kvflow run-batch --ray [ADDRESS] --replicas N`: the run-batch command's Ray flags and their dispatch (the command
itself is `server/run_batch.py`'s; without `--ray` it runs as before, on one engine)."""
from __future__ import annotations

import argparse
import sys
import time

from kvflow.ray.extra import require_ray
from kvflow.ray.batch import DEFAULT_BATCH_SIZE

RAY_ONLY = ("replicas", "num_cpus_per_replica", "threads_per_replica", "ray_batch_size")


def add_ray_batch_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ray", "shard the file over a Ray cluster (needs the extra: pip install 'kvflow[ray]')")
    g.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run on a Ray cluster: ADDRESS (host:port of its head, ray://..., or auto), or none for "
                        "Ray's default (RAY_ADDRESS, else a cluster started on this machine, else a new local one); "
                        "put MODEL before --ray or give it as --model")
    g.add_argument("--replicas", type=int, default=None, help="engines, one per Ray actor (default: 1)")
    g.add_argument("--num-cpus-per-replica", type=float, default=None,
                   help="CPUs Ray reserves for each replica (default: 1)")
    g.add_argument("--threads-per-replica", type=int, default=None,
                   help="CPU threads of each replica's engine (default: Ray's, the replica's CPUs)")
    g.add_argument("--ray-batch-size", type=int, default=None,
                   help=f"lines per Ray Data batch: what a restarted replica runs again (default: {DEFAULT_BATCH_SIZE})")
    single = p.get_default("func")
    p.set_defaults(func=lambda args: run_batch_command(args, single))


def run_batch_command(args, single) -> int:
    if args.ray is None:
        given = [f"--{name.replace('_', '-')}" for name in RAY_ONLY if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --ray")
        return single(args)
    try:
        require_ray()
    except ImportError as e:
        raise ValueError(f"--ray: {e}") from None

    from kvflow.ray.batch import RayBatchSettings, run_batch
    from kvflow.server.batch.runner import BatchCounts, done_keys, read_input
    from kvflow.server.common.flags import setup_logging
    from kvflow.server.run_batch import config_from_args

    setup_logging(args.log_level)
    config = config_from_args(args)
    settings = RayBatchSettings(address=args.ray or None, replicas=args.replicas or 1,
                                num_cpus_per_replica=args.num_cpus_per_replica or 1.0,
                                threads_per_replica=args.threads_per_replica,
                                batch_size=args.ray_batch_size or DEFAULT_BATCH_SIZE)
    settings.validate()
    lines = read_input(args.input_file)
    skipped = len(lines) - len([line for line in lines if line.key not in done_keys(args.output_file)])
    counts = BatchCounts()
    t0 = time.perf_counter()
    try:
        run_batch(args.input_file, args.output_file, config, settings=settings, max_concurrency=args.max_concurrency,
                  progress=not args.no_progress and sys.stderr.isatty(), counts=counts)
    except KeyboardInterrupt:
        print(f"run-batch: interrupted after {counts.done} line(s); what finished is in {args.output_file}: "
              "rerun the same command to resume", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"run-batch: {e}", file=sys.stderr)
        return 1
    print(f"run-batch: {counts.done} line(s) processed ({counts.failed} failed), {skipped} skipped "
          f"(already in {args.output_file}), in {time.perf_counter() - t0:.1f}s on {settings.replicas} Ray "
          f"replica(s)", file=sys.stderr)
    return 0
