"""Integrations with other frameworks, imported only by what uses them (they import those frameworks).

- :mod:`twinkle_ray.integrations.vllm_engine`: the weight-transfer engine vLLM engines receive
  weight syncs through (needs ``vllm``).
"""
