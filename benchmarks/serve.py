"""``python -m benchmarks.serve ...``: the serving benchmark (benchmarks/bench_serve.py)."""

from benchmarks.bench_serve import main

if __name__ == "__main__":
    main()
