# syntax=docker/dockerfile:1
# The gpufeed image: `gpufeed worker`, `gpufeed beat` and every other command (see compose.yaml).
# The build stage has the compiler and headers: it builds the gpufeed wheel, its native library
# inside, from the whole source tree (.dockerignore keeps local environments and build outputs
# out), and Pillow-SIMD against libjpeg-turbo, zlib, libwebp, libtiff and openjpeg, as
# scripts/setup.sh does on a workstation. The runtime stage installs those wheels and keeps only
# the shared libraries.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG PILLOW_SIMD_VERSION=12.1.1.post0
# -mavx2 suits every x86 server of the last decade; build with SIMD_CFLAGS=-msse4 for older CPUs.
# (gpufeed's own library needs no such flag: it picks its AVX2 kernels at run time.)
ARG SIMD_CFLAGS=-mavx2
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libjpeg62-turbo-dev zlib1g-dev libwebp-dev \
      libtiff-dev liblcms2-dev libopenjp2-7-dev libfreetype-dev \
 && rm -rf /var/lib/apt/lists/*
RUN CC="cc ${SIMD_CFLAGS}" pip wheel --no-deps --no-cache-dir --no-binary pillow-simd \
      "pillow-simd==${PILLOW_SIMD_VERSION}" -w /wheels
COPY . /src
RUN pip wheel --no-deps --no-cache-dir /src -w /wheels

FROM ${PYTHON_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends libjpeg62-turbo zlib1g libwebp7 libwebpmux3 libwebpdemux2 \
      libtiff6 liblcms2-2 libopenjp2-7 libfreetype6 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /tmp/wheels
# The CPU build of torch first, so resolving gpufeed keeps it instead of a multi-GB CUDA build;
# then gpufeed with the service and the charts; then Pillow-SIMD in place of the Pillow it pulled in.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch>=2.1" \
 && gpufeed_wheel="$(ls /tmp/wheels/gpufeed-*.whl)" \
 && pip install --no-cache-dir "${gpufeed_wheel}[service,plots]" \
 && pip uninstall -y pillow \
 && pip install --no-cache-dir --no-deps /tmp/wheels/pillow_simd-*.whl \
 && rm -rf /tmp/wheels
# The image's own check (tests/test_install.py runs this same command in a fresh venv): the native
# library loads from the installed wheel, not from a build at run time, and gpufeed doctor runs.
RUN python -c "from pipeline import native; where = native.library_info(); print('native library:', where.summary); assert where.origin == 'extension', where.problem" \
 && gpufeed doctor
RUN useradd --create-home --uid 10001 gpufeed \
 && mkdir -p /data /shards && chown gpufeed /shards
USER gpufeed
ENV PYTHONUNBUFFERED=1 \
    GPUFEED_ALLOWED_ROOTS=/data:/shards
CMD ["gpufeed", "worker"]
