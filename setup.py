"""Build the optional cropped-decode extension (needs libjpeg-turbo's headers, e.g. Debian's libjpeg-dev).

If it cannot be built, gpufeed installs without it and decodes whole JPEGs with simplejpeg instead;
`gpufeed info` says which is in use.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("gpufeed.decode._turbo_crop", sources=["src/gpufeed/decode/_turbo_crop.c"], libraries=["jpeg"],
                  optional=True),
    ]
)
