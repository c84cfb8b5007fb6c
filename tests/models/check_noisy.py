"""The small check model, but noisy: it prints to stdout when imported and when built, which
must not reach ``memplan check --json``'s stdout."""

from check_small import build_model as _build_small
from check_small import make_batch, training_loss  # noqa: F401  (the model-file contract)

print("hello from the model file's top level")


def build_model():
    print("building the model")
    return _build_small()
