"""What the off-policy algorithms (DQN, SAC, TD3, DDPG) share: the lean collection loop and its transition store."""
