import pytest
import torch as th
from stable_baselines3.common.torch_layers import NatureCNN

from sb3_speedups.errors import UserError
from sb3_speedups.zoo.kwargs_parser import parse_kwargs_string


@pytest.mark.parametrize(
    "source, expected",
    [
        ("dict(net_arch=[64, 64], activation_fn=nn.ReLU)", {"net_arch": [64, 64], "activation_fn": th.nn.ReLU}),
        (
            "dict(log_std_init=-2, ortho_init=False, net_arch=dict(pi=[256], vf=[256]))",
            {"log_std_init": -2, "ortho_init": False, "net_arch": {"pi": [256], "vf": [256]}},
        ),
        ("{'norm_obs': False, 'norm_reward': True}", {"norm_obs": False, "norm_reward": True}),
        (
            "dict(features_extractor_class=NatureCNN, optimizer_class=th.optim.RMSprop)",
            {"features_extractor_class": NatureCNN, "optimizer_class": th.optim.RMSprop},
        ),
        (
            "dict(activation_fn=torch.nn.Tanh, x=(1, 2), y=None, z=1e-3, w=+3)",
            {"activation_fn": th.nn.Tanh, "x": (1, 2), "y": None, "z": 1e-3, "w": 3},
        ),
        (
            "dict(goal_selection_strategy='future', n_sampled_goal=4)",
            {"goal_selection_strategy": "future", "n_sampled_goal": 4},
        ),
        ("dict({'a': 1}, b=2)", {"a": 1, "b": 2}),
        ("[1, 'two', [3.0]]", [1, "two", [3.0]]),
    ],
)
def test_accepts_rl_zoo_strings(source, expected):
    assert parse_kwargs_string(source) == expected


@pytest.mark.parametrize(
    "source",
    [
        "__import__('os').system('echo pwned')",
        "os.system('echo pwned')",
        "dict(x=open('/etc/passwd').read())",
        "lambda: 1",
        "[x for x in range(3)]",
        "().__class__.__bases__[0].__subclasses__()",
        "nn.ReLU.__subclasses__()",
        "dict(**{'a': 1})",
        "{**{'a': 1}}",
        "dict(a=1 + 2)",
        "dict(a=exec)",
        "getattr(nn, 'ReLU')",
        "th.load('x.pt')",
        "dict(a=-'x')",
        "dict(a=[1,",
    ],
)
def test_rejects_code(source):
    with pytest.raises(UserError) as info:
        parse_kwargs_string(source)
    assert "\n" not in str(info.value)
