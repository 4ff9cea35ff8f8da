"""The data plane: the chunk store, the transfer engine and its copy threads, the
copies themselves (torch, positional file I/O, the native loop), the regions
engines map, and the fd broker that takes their sealed memfds."""
