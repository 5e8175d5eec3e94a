import numpy as np
import pytest

from ferro_fsdp import Module, Parameter, nn


class Net(Module):
    def __init__(self):
        super().__init__()
        self.scale = Parameter(np.ones(3))
        self.fc = nn.Linear(3, 2, dtype=np.float64, rng=0)
        self.not_registered = np.zeros(2)
        self.shift = Parameter(np.zeros(2))

    def forward(self, x):
        return self.fc(x * self.scale.data) + self.shift.data


def test_attributes_register_in_assignment_order():
    net = Net()
    assert [n for n, _ in net.named_parameters()] == ["scale", "fc.weight", "fc.bias", "shift"]
    assert net.parameters()[1] is net.fc.weight
    assert [n for n, _ in net.named_modules()] == ["", "fc"]
    assert net.children() == [net.fc]
    assert net.num_parameters() == 3 + 6 + 2 + 2


def test_reassign_keeps_position_and_other_values_unregister():
    net = Net()
    net.scale = Parameter(np.zeros(3))
    assert [n for n, _ in net.named_parameters()][0] == "scale"
    net.scale = None
    assert [n for n, _ in net.named_parameters()] == ["fc.weight", "fc.bias", "shift"]
    del net.shift
    assert [n for n, _ in net.named_parameters()] == ["fc.weight", "fc.bias"]
    assert net.named_parameters(recurse=False) == []


def test_shared_parameter_is_listed_once():
    class Tied(Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2, rng=0)
            self.b = nn.Linear(2, 2, rng=1)
            self.b.weight = self.a.weight

    assert [n for n, _ in Tied().named_parameters()] == ["a.weight", "a.bias", "b.bias"]


def test_subclass_without_super_init_still_registers():
    class Lazy(Module):
        def __init__(self):
            self.w = Parameter(np.ones(2))

    assert [n for n, _ in Lazy().named_parameters()] == ["w"]


def test_train_eval_call_zero_grad_state_dict():
    net = Net()
    assert net.training and net.fc.training
    net.eval()
    assert not net.training and not net.fc.training
    net.train()
    assert net.fc.training
    out = net(np.ones((4, 3)))
    assert out.shape == (4, 2)
    for p in net.parameters():
        p.grad = np.ones_like(p.data)
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())
    sd = net.state_dict()
    other = Net()
    other.fc.weight.data = np.zeros((2, 3))
    other.load_state_dict(sd)
    np.testing.assert_array_equal(other.fc.weight.data, net.fc.weight.data)
    sd["fc.weight"][0, 0] = 99.0  # a copy
    assert net.fc.weight.data[0, 0] != 99.0
    with pytest.raises(KeyError, match="missing"):
        other.load_state_dict({})
    with pytest.raises(ValueError, match="shape"):
        other.load_state_dict({**sd, "shift": np.zeros(5)})


def test_module_without_forward_or_backward():
    m = Module()
    with pytest.raises(NotImplementedError):
        m(1)
    with pytest.raises(NotImplementedError):
        m.backward(1)
    with pytest.raises(TypeError):
        m.register_parameter("x", np.zeros(1))
    with pytest.raises(TypeError):
        m.add_module("x", np.zeros(1))


def test_parameter_basics():
    p = Parameter([1.0, 2.0])
    assert p.grad is None and p.requires_grad and p.shape == (2,) and p.size == 2
    p.accumulate_grad(np.ones(2))
    p.accumulate_grad(np.ones(2))
    np.testing.assert_array_equal(p.grad, [2.0, 2.0])
    with pytest.raises(ValueError, match="shape"):
        p.accumulate_grad(np.ones(3))
    frozen = Parameter(np.ones(2), requires_grad=False)
    frozen.accumulate_grad(np.ones(2))
    assert frozen.grad is None
    assert "shape=(2,)" in repr(p)
    assert "Linear(in_features=3" in repr(Net())


def test_grads_ready_hooks_fire_inside_a_linear_backward_once_its_gradients_are_written():
    layer = nn.Linear(3, 2, rng=0)
    seen = []
    layer.register_grads_ready_hook(
        lambda m: seen.append(("ready", m is layer, layer.weight.grad is not None)))
    layer.register_backward_hook(lambda m, args, out: seen.append(("returned",)))
    x = np.ones((4, 3), np.float32)
    layer(x)
    layer.backward(np.ones((4, 2), np.float32))
    assert seen == [("ready", True, True), ("returned",)]
    with pytest.raises(TypeError, match="is not callable"):
        layer.register_grads_ready_hook(3)

    class Plain(Module):  # says nothing: only its backward hooks fire
        def forward(self, x):
            return x

        def backward(self, g):
            return g

    plain, calls = Plain(), []
    handle = plain.register_grads_ready_hook(lambda m: calls.append(m))
    plain(x)
    plain.backward(x)
    plain.grads_ready()  # (a module's own backward would call it)
    handle.remove()
    plain.grads_ready()
    assert calls == [plain]
