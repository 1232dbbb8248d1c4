"""relayrl.envs: environments other people publish, run unchanged as relayrl episodes.

One module per ecosystem (`reasoning_gym`, `verifiers`, `textarena`, `openenv`, `nemo_gym`).
Each takes the environment's own tasks and its own scorer, and lets the policy answer through the
gateway the way any agent does (an OpenAI client on the episode's session URL). The ecosystem's
package is an optional extra named after it (`pip install 'relayrl[reasoning-gym]'`), or for
verifiers and NeMo Gym an environment of its own (`scripts/install_verifiers.sh`,
`scripts/install_nemo_gym.sh`), imported only when used, with an error naming the install command
when it is missing.

May import: `relayrl.workflow`, `relayrl.client`, `relayrl.errors`; never torch.
"""
