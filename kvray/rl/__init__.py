"""Reinforcement learning of placement policies: the gymnasium environment
(``kvray/Placement-v0``, :mod:`kvray.rl.env`) around the simulator, and PPO training
(:mod:`kvray.rl.train`, ``kvray train``). The trained policy itself is served by
:class:`kvray.policy.rl.RLPolicy`, which needs neither gymnasium nor stable-baselines3."""
