#!/usr/bin/env bash
# Builds the binary wheel the way a release would (isolated `pip wheel`: build requirements from pyproject.toml),
# checks what is inside, installs it into a fresh venv with its dependencies and pytest, and checks that it
# imports there, from outside the source tree, with the native extension loaded wherever the build had nvcc.
#
# usage: scripts/check_wheel.sh [SOURCE_DIR]        (default: the repository that holds this script)
# environment:
#   PYTHON=python3            interpreter for the build and the venv
#   WHEEL_DIR=DIR             keep the wheel there (default: a temporary folder, removed at the end)
#   WHEEL=FILE                check this wheel instead of building one (e.g. on a GPU machine without network)
#   CHECK_WHEEL_EXTRAS=nvshmem   extras installed with the wheel (GPU machine: cuda)
#   CHECK_WHEEL_TESTS="tests/test_native_build.py"   test files (relative to SOURCE_DIR) run in the venv against the
#                             installed wheel ("" for none; GPU machine: "tests/gpu")
#   CHECK_WHEEL_NO_ISOLATION=1   build with --no-build-isolation (offline machines; against what PYTHON has)
#   CHECK_WHEEL_OFFLINE=1     no index: the venv sees PYTHON's site-packages (a .pth file, after its own) for the
#                             dependencies and pytest, and gets the wheel (plus any wheels in CHECK_WHEEL_FIND_LINKS)
#                             with --no-index; for machines without network such as the GPU machine
#   KEEP=1                    keep the temporary folder (build log, venv)
# The build directory is always a fresh temporary one: the source tree's build/ is never touched.
set -euo pipefail
src=$(cd "${1:-$(dirname "$0")/..}" && pwd)
py=${PYTHON:-python3}
extras=${CHECK_WHEEL_EXTRAS-nvshmem}
tests=${CHECK_WHEEL_TESTS-tests/test_native_build.py}
work=$(mktemp -d "${TMPDIR:-/tmp}/jax_ep_check_wheel.XXXXXX")
dist=${WHEEL_DIR:-$work/dist}
cleanup() { if [[ -z "${KEEP:-}" ]]; then rm -rf "$work"; else echo "kept $work"; fi; }
trap cleanup EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
fail() { echo "check_wheel: FAIL: $*" >&2; exit 1; }
t_start=$SECONDS

# Where CMakeLists.txt would find nvcc, there the native part must be built: JAX_EP_NATIVE=ON turns a skipped
# native part into a build error instead of a pure-Python wheel.
nvcc=""
for c in "${CUDACXX:-}" "$(command -v nvcc || true)" "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" \
         "${CUDA_PATH:+$CUDA_PATH/bin/nvcc}" /usr/local/cuda/bin/nvcc; do
  if [[ -n "$c" && -x "$c" ]]; then nvcc=$c; break; fi
done
if [[ "${JAX_EP_NATIVE:-AUTO}" == "OFF" ]]; then
  expect_native=0
elif [[ -n "$nvcc" ]]; then
  expect_native=1; export JAX_EP_NATIVE=ON
else
  expect_native=0
fi
echo "== check_wheel: source $src, python $($py -c 'import sys; print(sys.version.split()[0])'), nvcc ${nvcc:-none}" \
     "-> native extension expected: $([[ $expect_native == 1 ]] && echo yes || echo no)"

if [[ -n "${WHEEL:-}" ]]; then
  wheel=$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")
  [[ -f "$wheel" ]] || fail "no wheel at $WHEEL"
  echo "== checking the given wheel $wheel (no build)"
else
echo "== build the wheel ($([[ -n "${CHECK_WHEEL_NO_ISOLATION:-}" ]] && echo 'no build isolation' || echo 'isolated build'))"
iso=()
[[ -n "${CHECK_WHEEL_NO_ISOLATION:-}" ]] && iso=(--no-build-isolation)
t0=$SECONDS
if ! $py -m pip wheel --no-deps -v "${iso[@]}" -w "$dist" -C build-dir="$work/build" "$src" >"$work/build.log" 2>&1; then
  tail -n 40 "$work/build.log" >&2
  fail "wheel build failed (log above)"
fi
sed -n 's/^[[:space:]]*\(-- \)\{0,1\}\(jax_ep: .*\)/  \2/p' "$work/build.log"
echo "built in $((SECONDS - t0)) s"
wheel=$(ls -t "$dist"/jax_ep-*.whl | head -n 1)
fi
echo "wheel: $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"

echo "== contents"
$py - "$wheel" "$expect_native" "$work/unpacked" <<'EOF'
import sys, zipfile
wheel, expect_native, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
z = zipfile.ZipFile(wheel)
names = z.namelist()
for n in names:
    if not n.endswith(".py"):
        print(f"  {z.getinfo(n).file_size:>11,}  {n}")
print(f"  ({sum(n.endswith('.py') for n in names)} .py files)")
tag = wheel.rsplit("/", 1)[-1].split("-", 2)[2]
native = [n for n in names if n.startswith("jax_ep/_jax_ep_native") and n.endswith(".so")]
nvshmem = [n for n in names if n.startswith("jax_ep/_jax_ep_nvshmem") and n.endswith(".so")]
errors = []
if "jax_ep/__init__.py" not in names:
    errors.append("jax_ep/__init__.py missing")
if "jax_ep/py.typed" not in names:
    print("  note: no jax_ep/py.typed in the wheel")
if any("__pycache__" in n or n.startswith("tests/") for n in names):
    errors.append("stray files (__pycache__ or tests/) in the wheel")
if expect_native:
    if not native:
        errors.append("jax_ep/_jax_ep_native*.so is not in the wheel although nvcc was found")
    if not nvshmem:
        errors.append("jax_ep/_jax_ep_nvshmem*.so is not in the wheel although nvcc was found")
    if tag.endswith("none-any.whl"):
        errors.append(f"a native wheel must carry a platform tag, got {tag}")
elif native:
    print("  note: native extension present although none was expected")
if errors:
    sys.exit("check_wheel: FAIL: " + "; ".join(errors))
for n in native + nvshmem:
    z.extract(n, out)
print(f"  tag {tag}: native module {'yes' if native else 'no'}, NVSHMEM module {'yes' if nvshmem else 'no'}")
EOF

if [[ $expect_native == 1 ]] && command -v readelf >/dev/null; then
  echo "== dynamic section (readelf -d)"
  for so in "$work"/unpacked/jax_ep/*.so; do
    needed=$(readelf -d "$so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
    rpath=$(readelf -d "$so" | sed -n 's/.*(\(RUNPATH\|RPATH\)).*\[\(.*\)\]/\2/p')
    echo "  $(basename "$so"): NEEDED $needed| RUNPATH ${rpath:-none}"
    case "$(basename "$so")" in
      _jax_ep_native*)
        [[ "$needed" != *nvshmem* && "$needed" != *libcuda.so* && "$needed" != *libcudart.so* ]] ||
          fail "the main module must not need NVSHMEM, libcuda or a shared cudart (imports on CPU-only machines)";;
      _jax_ep_nvshmem*)
        [[ "$needed" == *libnvshmem_host.so.3* ]] || fail "the NVSHMEM module does not link libnvshmem_host.so.3"
        [[ "$rpath" == *'$ORIGIN/../nvidia/nvshmem/lib'* ]] ||
          fail "the NVSHMEM module has no relative RUNPATH to the nvidia-nvshmem-cu13 wheel"
        for p in ${rpath//:/ }; do
          [[ "$p" == '$ORIGIN'* || -d "$p" ]] ||
            echo "  note: RUNPATH entry $p does not exist here (a build-time path; harmless, found through \$ORIGIN)"
        done;;
    esac
  done
fi

echo "== fresh venv: the wheel${extras:+ [$extras]}, its dependencies and pytest"
t0=$SECONDS
vpy="$work/venv/bin/python"
if [[ -n "${CHECK_WHEEL_OFFLINE:-}" ]]; then
  # Not --system-site-packages: PYTHON may itself be a venv, whose packages that option would not show.
  $py -m venv "$work/venv"
  "$py" -c "import site; print('\n'.join(site.getsitepackages() + [site.getusersitepackages()]))" \
    >"$("$vpy" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_check_wheel_parent_site.pth"
  links=(--find-links "$(dirname "$wheel")")
  [[ -n "${CHECK_WHEEL_FIND_LINKS:-}" ]] && links+=(--find-links "$CHECK_WHEEL_FIND_LINKS")
  "$vpy" -m pip install -q --no-index "${links[@]}" "${wheel}${extras:+[$extras]}" pytest 2>&1 |
    grep -v -E "^(WARNING: Running pip as|WARNING: Location .* is ignored|$)" || true
else
  $py -m venv "$work/venv"
  "$vpy" -m pip install -q "${wheel}${extras:+[$extras]}" pytest 2>&1 |
    grep -v -E "^(WARNING: Running pip as|WARNING: Location .* is ignored|$)" || true
fi
"$vpy" -m pip show jax_ep >/dev/null 2>&1 || fail "jax_ep did not install into the venv"
echo "installed in $((SECONDS - t0)) s: $("$vpy" -m pip list 2>/dev/null | grep -i -E '^(jax|jaxlib|jax_ep|nvidia-nvshmem-cu13) ' |
  tr -s ' ' | paste -sd ',' -)"

echo "== import from the venv (outside the source tree)"
with_nvshmem=0
[[ ",$extras," == *,nvshmem,* || ",$extras," == *,cuda,* ]] && with_nvshmem=1
(cd "$work" && "$vpy" - "$expect_native" "$with_nvshmem" <<'EOF'
import os, sys
import jax_ep, jax_ep._native as n
expect, with_nvshmem = sys.argv[1] == "1", sys.argv[2] == "1"
where = os.path.dirname(jax_ep.__file__)
assert "venv" in where, f"imported jax_ep from {where}, not from the venv"
print(f"jax_ep {jax_ep.__version__} from {where}; native available: {n.available()}"
      + ("" if n.available() else f" ({n.load_error()})"))
if expect and not n.available():
    sys.exit("check_wheel: FAIL: the build had nvcc but the native extension does not load")
if n.available():
    info = n.info()
    print(f"  FFI API {info['ffi_api_version']}, CUDA runtime {info['cuda_runtime_version']}, "
          f"{len(info['targets'])} targets; registered: {len(n.ensure_registered())}")
    if with_nvshmem:  # nvidia-nvshmem-cu13 came with the extras: the NVSHMEM module must load from it
        try:
            import jax_ep._jax_ep_nvshmem  # loads libnvshmem_host.so.3 through the module's relative RUNPATH
        except ImportError as e:
            sys.exit(f"check_wheel: FAIL: jax_ep._jax_ep_nvshmem does not import: {e}")
        print("  jax_ep._jax_ep_nvshmem imports (libnvshmem_host.so.3 found through its RUNPATH)")
EOF
) || fail "import check"
if [[ $expect_native == 1 ]]; then
  # Every library and symbol a module needs (besides Python's, which the interpreter provides) must resolve in the
  # venv. The NVSHMEM module was built against the oldest supported NVSHMEM and meets the venv's (the newest).
  for so in "$work"/venv/lib/python*/site-packages/jax_ep/_jax_ep_*.so; do
    [[ "$so" == *_jax_ep_nvshmem* && $with_nvshmem == 0 ]] && continue  # no nvidia-nvshmem-cu13 in the venv
    deps=$(ldd -r "$so" 2>&1)
    missing=$(grep -E "undefined symbol|not found" <<<"$deps" | grep -v -E "undefined symbol: _?Py" || true)
    [[ -z "$missing" ]] || { echo "$missing" >&2; fail "$(basename "$so"): unresolved libraries or symbols in the venv"; }
    if [[ "$so" == *_jax_ep_nvshmem* ]]; then
      line=$(grep "libnvshmem_host.so.3 =>" <<<"$deps" | tr -s ' \t' ' ')
      [[ "$line" == *"=> $work/venv/lib/python"*"/site-packages/jax_ep/../nvidia/nvshmem/lib/libnvshmem_host.so.3"* ]] ||
        fail "libnvshmem_host.so.3 is not resolved from the venv's nvidia-nvshmem-cu13:$line"
      echo "  ldd -r: every symbol resolves; $line"
    fi
  done
fi

if [[ -n "$tests" ]]; then
  echo "== pytest in the venv against the installed wheel: $tests"
  args=()
  for t in $tests; do args+=("$src/$t"); done
  # Run from the temporary folder so that `import jax_ep` finds the installed wheel, not the source tree (checked
  # after the run: the jax_ep the tests imported must be the venv's).
  (cd "$work" && "$vpy" - "${args[@]}" <<'EOF' 2>&1 | tail -n 15) || fail "tests failed in the venv"
import sys, pytest
rc = pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]])
mod = sys.modules.get("jax_ep")
if mod is not None and "venv" not in mod.__file__:
    sys.exit(f"the tests imported jax_ep from {mod.__file__}, not from the venv")
sys.exit(int(rc))
EOF
fi
echo "== check_wheel: OK ($((SECONDS - t_start)) s)"
