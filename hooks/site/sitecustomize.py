"""gpulens trainer hook: arms Kineto daemon mode and registers this worker before `import torch`.

Put this folder (`gpulens hook-path`) on PYTHONPATH. It needs nothing but the standard library, so
it works in any trainer image. Any failure is one line on stderr; training always runs on. An
existing `sitecustomize` further down sys.path (the image's own) still runs, after arming.
"""

import os as _os
import sys as _sys

try:
    _sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
    try:
        import _gpulens_hook
    finally:
        del _sys.path[0]
    _gpulens_hook.main()
except Exception as _exc:  # never break training
    print(f"gpulens-hook: not armed: {type(_exc).__name__}: {_exc}", file=_sys.stderr)
else:
    _gpulens_hook.chain_sitecustomize(__file__)
