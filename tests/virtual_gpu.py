"""A virtual GPU: run the engine on the CPU while every tensor carries the device it would live on.

What this is
    The crashes that only a GPU shows are of two kinds: a tensor made on the CPU meets a CUDA
    tensor in one op ("Expected all tensors to be on the same device"), or a random draw mixes a
    CUDA generator with CPU tensors. Neither needs a GPU to be found, only a record of where each
    tensor would be. `VirtualGPU` is a `TorchFunctionMode` that keeps that record while the real
    data stays on the CPU, so the engine runs a whole step, and checks every call against it:

        torch.zeros(3, device="cuda")      -> a CPU tensor, labelled cuda
        x.to("cuda"), x.cuda()             -> a copy, labelled cuda; x.cpu() -> a copy, labelled cpu
        any other op                       -> labelled as its tensor inputs; inputs on two devices
                                              raise DeviceMismatch (a 0-dim CPU tensor may join in,
                                              as torch allows), as does a generator on another
                                              device than its draw
        x.tolist(), x.item(), int(x), ...  -> on a cuda tensor: a host sync, counted where it was asked

    Labels live on storages (views and `param.data = ...` share them); `torch.Generator(device=)`
    and the few `torch.cuda` calls the engine makes are stood in for while the mode is on.

What this is not
    A simulator of CUDA's semantics: kernels, streams and memory are the CPU's; an op CUDA would
    accept with mixed devices but this mode rejects (or the reverse) is possible at the edges
    (indexing takes CPU indices either way, as torch does). It checks devices, not speed.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
# On a machine with a real GPU, triton is imported compiled: a kernel launched on the virtual GPU's CPU
# memory is refused there, so the tests that reach a Triton launch under the mode skip on such a machine.
REAL_CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[1]

SYNCS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero,
         torch.Tensor.__array__, torch.Tensor.__format__, torch.Tensor.__repr__}  # fmt: skip
DEVICE, IS_CUDA = torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__  # compare with ==: each access makes a new wrapper
LENIENT = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.copy_}  # CPU indices/sources are fine


class DeviceMismatch(AssertionError):
    """What CUDA would raise: two devices in one op, or a generator on the wrong one."""


class VirtualGenerator(torch.Generator):
    """A CPU generator that says which device it was asked for."""

    def __new__(cls, device="cpu"):
        gen = super().__new__(cls)  # a real CPU generator, whatever device was asked for
        gen.virtual_device = torch.device(device)
        return gen

    def __init__(self, device="cpu"):
        super().__init__()


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _norm(device) -> torch.device:
    """"cuda" means the current GPU, cuda:0 here."""
    device = torch.device(device)
    return CUDA if device.type == "cuda" and device.index is None else device


class VirtualGPU(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self._by_storage: dict[int, torch.device] = {}
        self._by_tensor = WeakTensorKeyDictionary()  # for storage-less (size 0, meta) tensors
        self.syncs: Counter[str] = Counter()  # "file:function" -> host syncs asked there
        # "file:function" -> copies to the device that wait for it: torch.tensor(data, device="cuda") and
        # .to("cuda") without non_blocking copy from pageable memory and synchronise the stream first
        self.copies: Counter[str] = Counter()

    # --- labels ----------------------------------------------------------------------------------
    def device_of(self, t: torch.Tensor) -> torch.device:
        if t.device.type != "cpu":
            return t.device  # meta
        ptr = t.untyped_storage().data_ptr()
        return (self._by_storage.get(ptr) if ptr else self._by_tensor.get(t)) or CPU

    def _label(self, t: torch.Tensor, device: torch.device) -> None:
        if t.device.type != "cpu":
            return
        ptr = t.untyped_storage().data_ptr()
        if ptr:
            self._by_storage[ptr] = device
        else:
            self._by_tensor[t] = device

    def label_all(self, tree, device) -> None:
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor):
                self._label(t, torch.device(device))

    # --- the check -------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == DEVICE or func == IS_CUDA:
            dev = self.device_of(args[0])
            return dev if func == DEVICE else dev.type == "cuda"
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in SYNCS:
            if tensors and self.device_of(tensors[0]).type == "cuda":
                self.syncs[_caller()] += 1
            return func(*args, **kwargs)
        if func is torch.Tensor.to:
            return self._to(args, kwargs)
        if func is torch.Tensor.cuda:
            return self._moved(args[0], args[1] if len(args) > 1 and args[1] is not None else kwargs.get("device") or CUDA)
        if func is torch.Tensor.cpu:
            return self._moved(args[0], CPU)
        if func is torch.Tensor.__getitem__ and self.device_of(args[0]).type == "cuda":
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_flatten(args[1])[0]):
                self.syncs[_caller()] += 1  # a boolean mask: the result's size is on the device
        device = self._device_of_call(func, args, kwargs, tensors)
        if _is_cuda(kwargs.get("device")):
            if func in (torch.tensor, torch.as_tensor):
                self.copies[_caller()] += 1  # data from the host: a blocking copy
            kwargs["device"] = CPU
        out = func(*args, **kwargs)
        if func not in (torch.Tensor.copy_, torch.Tensor.__setitem__):  # in place: the label stays
            self.label_all(out, device)
        return out

    def _device_of_call(self, func, args, kwargs, tensors) -> torch.device:
        if kwargs.get("device") is not None:
            device = _norm(kwargs["device"])
        else:
            devices = {self.device_of(t) for t in tensors if t.dim() > 0 or self.device_of(t).type != "cpu"}
            if func in LENIENT:
                devices = {self.device_of(args[0])} if args and isinstance(args[0], torch.Tensor) else devices
            if len(devices) > 1:
                raise DeviceMismatch(f"{_name(func)} at {_caller()}: tensors on {sorted(map(str, devices))}")
            device = devices.pop() if devices else (CPU if not tensors else self.device_of(tensors[0]))
        gen = kwargs.get("generator")
        if gen is not None:
            gen_device = getattr(gen, "virtual_device", gen.device)
            if gen_device.type != device.type:
                raise DeviceMismatch(
                    f"{_name(func)} at {_caller()}: Expected a '{device.type}' device type for generator "
                    f"but found '{gen_device.type}'"
                )
        return device

    def _to(self, args, kwargs):
        """Tensor.to(device | dtype | tensor, ...): the real call on the CPU, the label moved."""
        src, target, rest = args[0], kwargs.pop("device", None), []
        for a in args[1:]:
            if isinstance(a, (torch.device, str)):
                target = a
            elif isinstance(a, torch.Tensor):  # .to(other): other's device and dtype
                target = self.device_of(a)
                rest.append(a.dtype)
            else:
                rest.append(a)
        if not kwargs.pop("non_blocking", False) and target is not None and _norm(target).type == "cuda":
            if self.device_of(src).type == "cpu":
                self.copies[_caller()] += 1
        out = src.to(*rest, **kwargs)
        return self._moved(out, torch.device(target) if target is not None else self.device_of(src), src)

    def _moved(self, t, device, src=None):
        src, device = t if src is None else src, _norm(device)
        if self.device_of(src) == device:
            return t
        if t.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
            t = t.clone()  # a move makes a new tensor, so the old one keeps its label
        self._label(t, device)
        return t


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _caller() -> str:
    """The innermost frame of the project's own code (not torch's, not this file's)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = Path(frame.filename)
        if ROOT in path.parents and path.name != "virtual_gpu.py" and "tests" not in path.parts[len(ROOT.parts):][:1]:
            return f"{path.relative_to(ROOT)}:{frame.name}"
    return "elsewhere"


class _Event:
    def __init__(self, *a, **k):
        pass

    def record(self, *a):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.0


@contextlib.contextmanager
def virtual_gpu(monkeypatch, memory_gb: float = 80.0):
    """The mode on, with `torch.cuda` saying one GPU of `memory_gb` is there (nothing else of CUDA is stood in for)."""
    total = int(memory_gb * 2**30)
    props = SimpleNamespace(name="virtual GPU", total_memory=total, major=9, minor=0, multi_processor_count=132)
    for name, value in dict(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0, synchronize=lambda *a: None,
        mem_get_info=lambda *a: (total, total), get_device_properties=lambda *a: props, is_bf16_supported=lambda *a: True,
        device=lambda *a: contextlib.nullcontext(), empty_cache=lambda: None, manual_seed=lambda s: None,
        Event=_Event, get_device_name=lambda *a: props.name, set_device=lambda *a: None,
    ).items():  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch, "Generator", VirtualGenerator)
    mode = VirtualGPU()
    with mode:
        yield mode


def on_cuda(mode: VirtualGPU, tree):
    """Label every tensor of `tree` cuda (inputs made outside the mode); returns the tree."""
    mode.label_all(tree, CUDA)
    return tree


__all__ = ["DeviceMismatch", "VirtualGPU", "virtual_gpu", "on_cuda"]
