"""CPU compute shared by the engine and the trainer: the compiled C kernels and the core count.

The kernels (`relayrl.kernels.cpu`, sources in `csrc/`) are built with the machine's C compiler on
first use and cached under `$RELAYRL_HOME/kernels/`; each loader returns None where a kernel cannot
be built here, and callers then keep torch's ops. Set `RELAYRL_NO_CPU_KERNELS=1` to turn every
kernel off (torch's ops throughout).

Imports: models (for `relay_home`). Below engine and train, which both use it.
"""

from relayrl.kernels.cores import usable_cores
from relayrl.kernels.cpu import (
    DecodeAttention,
    DecodeStep,
    TrainKernels,
    decode_attention_kernel,
    decode_step_kernel,
    train_kernels,
)

__all__ = [
    "DecodeAttention",
    "DecodeStep",
    "TrainKernels",
    "decode_attention_kernel",
    "decode_step_kernel",
    "train_kernels",
    "usable_cores",
]
