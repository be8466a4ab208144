"""Launchers: `launch.slurm` (sbatch + srun + torchrun with a c10d rendezvous) and `launch.local`
(torchrun on this machine). They build command lines and scripts only and never import torch, so they
run on a login node without one."""
