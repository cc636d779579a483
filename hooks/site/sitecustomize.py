"""gpulens trainer hook: arms Kineto daemon mode and registers this worker before `import torch`.

Put this folder (`gpulens hook-path`) on PYTHONPATH. It needs nothing but the standard library, so
it works in any trainer image. Any failure is one line on stderr; training always runs on. The
image's own `PYTHONPATH`, when the webhook's init container saved it, goes back on sys.path first;
an existing `sitecustomize` further down sys.path (the image's own) still runs, after arming.
"""

import os as _os
import sys as _sys

try:
    _here = _os.path.dirname(_os.path.abspath(__file__))
    _sys.path.insert(0, _here)
    try:
        import _gpulens_hook
        import _gpulens_imagepath
    finally:
        del _sys.path[0]
    _gpulens_imagepath.restore(_here)   # the image's own PYTHONPATH, which arming replaced
    _gpulens_hook.main()
except Exception as _exc:  # never break training
    print(f"gpulens-hook: not armed: {type(_exc).__name__}: {_exc}", file=_sys.stderr)
else:
    _gpulens_hook.chain_sitecustomize(__file__)
