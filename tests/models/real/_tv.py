"""Import torchvision with the CPU build of torch: PyPI's torchvision wheel registers meta
kernels for its CUDA ops (``torchvision::nms``) that the CPU torch lacks. The models used
here need none of those ops, so the registration module is replaced by an empty one."""

import sys
import types

sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("_meta_registrations"))
