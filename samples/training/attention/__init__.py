"""Training-time attention: SDPA with sinks as an extra key, and band (sliding-window) attention in
window-sized query chunks, for the towers and the text model."""
