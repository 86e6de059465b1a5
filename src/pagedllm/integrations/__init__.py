"""Adapters for frameworks that drive pagedllm (RL rollout: ROLL, verl, OpenRLHF style)."""
