"""relayrl.envs: environments other people publish, run unchanged as relayrl episodes.

One module per ecosystem (`reasoning_gym`, `verifiers`, `textarena`, `openenv`). Each takes
the environment's own tasks and its own scorer, and lets the policy answer through the gateway
the way any agent does (an OpenAI client on the episode's session URL). The ecosystem's package
is an optional extra named after it (`pip install 'relayrl[reasoning-gym]'`), imported only
when used, with an `ImportError` naming the pip command when it is missing.

May import: `relayrl.workflow`, `relayrl.client`, `relayrl.errors`; never torch.
"""
