# Kernel sources of twellsparse, installed as the ``twellsparse.cuda`` package.
#
# In a checkout this folder is also importable as a top-level ``cuda`` package (the checkout's
# root is on sys.path when Python runs from it), which would shadow NVIDIA's ``cuda`` namespace
# (cuda.pathfinder, cuda.bindings) that CuPy imports. Extending __path__ pkgutil-style keeps
# every other ``cuda`` folder on sys.path reachable, so both work.
__path__ = __import__("pkgutil").extend_path(__path__, __name__)
