"""Small pieces every layer uses: user plug-ins sent to workers (`portable`), named seed streams
(`seeds`), a quiet TensorFlow start (`quiet`), shutdown signals (`shutdown`), and the module paths
from before the layered layout (`moved_modules`). This package's `__init__` imports nothing.
"""
