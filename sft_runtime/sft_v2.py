"""The seed API, at the import path users write: ``from sft_runtime.sft_v2 import ...``.

The module itself is `sft_runtime.runtime.sft_v2`; this name is the same module object, so
its private seed names (``_restore_save_state``, ...) and monkeypatching reach one module.
"""

import sys

from sft_runtime.runtime import sft_v2 as _module

sys.modules[__name__] = _module
