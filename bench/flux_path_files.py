"""The repository's source files whose code runs while a Flux pipeline loads and while one generation call runs
(sys.setprofile 'call' events): the "files on a Flux request's path" of issue 19, library side.

    python bench/flux_path_files.py          # counts, then one line per file: L (load), C (call)
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import meshserve  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(meshserve.__file__)))


def main() -> None:
    from meshserve.models import load_pipeline

    seen: set[str] = set()

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(ROOT) and "/tests/" not in path:
            seen.add(os.path.relpath(path, ROOT))

    sys.setprofile(profile)
    pipe = load_pipeline("tiny-flux")
    load = set(seen)
    seen.clear()
    pipe("a red circle", num_inference_steps=2, seed=0, output_type="np")
    call = set(seen)
    sys.setprofile(None)
    print(f"load: {len(load)}  call: {len(call)}  either: {len(load | call)}")
    for path in sorted(load | call):
        print(("L" if path in load else " ") + ("C" if path in call else " "), path)


if __name__ == "__main__":
    main()
