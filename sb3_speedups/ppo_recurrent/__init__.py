"""Fast drop-in for sb3-contrib's RecurrentPPO, with LSTM and GRU policies."""

from sb3_speedups.ppo_recurrent.policies import CnnGruPolicy, MlpGruPolicy, MultiInputGruPolicy
from sb3_speedups.ppo_recurrent.ppo_recurrent import RecurrentPPO

__all__ = ["CnnGruPolicy", "MlpGruPolicy", "MultiInputGruPolicy", "RecurrentPPO"]
