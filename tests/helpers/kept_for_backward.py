"""The bytes a forward pass leaves alive for its backward: every storage an operation created during the forward
that still exists once it returns (autograd's saved tensors, the block inputs a checkpoint keeps, the outputs a
selective checkpoint caches), counted once each. Parameters and inputs are not created by the forward, so they do
not count. Storages are followed through weak references to the storage itself (a tensor object may die while a
view or a cache keeps its memory). The views an operation returns of a parameter (a transposed weight) are left
out by the parameters' storages."""

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _CreatedStorages(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.created = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                self.created.append((StorageWeakRef(storage), storage.nbytes(), storage.data_ptr()))
        return out


def kept_for_backward(forward, module: torch.nn.Module) -> tuple[int, object]:
    """(bytes still alive after `forward()` among the storages it created, its result: keep it referenced);
    `module`: whose parameters and buffers are not counted."""
    own = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    mode = _CreatedStorages()
    with mode:
        result = forward()
    alive = {ref.cdata: nbytes for ref, nbytes, pointer in mode.created if not ref.expired() and pointer not in own}
    return sum(alive.values()), result
