"""Hopper (sm_90) attention kernels on Pallas Mosaic GPU: warp-specialised, TMA-fed,
warpgroup matrix products. Imports nothing from jflash."""
