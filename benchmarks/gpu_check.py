"""On a GPU machine: run the whole kernel test matrix, then the kernel benchmark.

    python benchmarks/gpu_check.py [--quick] [--skip-tests] [--skip-bench]

Tests: tests/test_kernels.py (every kernel kind × type vs gguf-py + float64 matmul, bf16-emulated references
for prefill, NaN-poisoned outputs, routing edge cases; and QuantWeight dispatch vs the fallback), plus
tests/test_weights.py and tests/test_quants.py on the GPU backend's default device.
Results go to $OUT (or /tmp): pytest.txt and kernel_speed.json.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    out = Path(os.environ.get("OUT", "/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("DS4_MLX_KERNELS", None)  # automatic backend: the GPU kernels
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
    rc = 0
    if "--skip-tests" not in sys.argv:
        tests = ["tests/test_kernels.py", "tests/test_weights.py", "tests/test_quants.py"]
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-o", "addopts=",
             "-o", "timeout=0", *tests],
            cwd=ROOT, env=env, capture_output=True, text=True,
        )
        (out / "pytest.txt").write_text(r.stdout + r.stderr)
        print(r.stdout[-6000:], r.stderr[-3000:], flush=True)
        rc |= r.returncode
    if "--skip-bench" not in sys.argv:
        args = [sys.executable, "benchmarks/kernel_speed.py", "--json", str(out / "kernel_speed.json")]
        if "--quick" in sys.argv:
            args.append("--quick")
        r = subprocess.run(args, cwd=ROOT, env=env)
        rc |= r.returncode
    sys.exit(rc)


if __name__ == "__main__":
    main()
