; Inno Setup 6 script: a per-user installer for Strata Desktop (no administrator rights needed).
; Built by packaging\windows\build.ps1 from the PyInstaller bundle in dist\strata-desktop\; by hand:
;   iscc /DAppVersion=0.1.0 packaging\windows\strata.iss
; The uninstaller removes the program, its shortcuts and the "start at login" shortcut (also one the app's
; Settings tab made); it leaves the user's settings and conversation cache (%LOCALAPPDATA%\strata) alone.

#ifndef AppVersion
  #define AppVersion "0.1.0"
#endif
#define AppName "Strata Desktop"
#define AppExe "strata-desktop.exe"
#define BundleDir "..\..\dist\strata-desktop"

[Setup]
AppId={{5E0B7C2A-6C1F-4D1B-9A57-2F1D3C8B6A41}
AppName={#AppName}
AppVersion={#AppVersion}
AppVerName={#AppName} {#AppVersion}
AppPublisher=Strata Desktop
; Per-user: {autopf} is %LOCALAPPDATA%\Programs under lowest privileges.
PrivilegesRequired=lowest
DefaultDirName={autopf}\{#AppName}
DefaultGroupName={#AppName}
DisableProgramGroupPage=yes
UsePreviousAppDir=yes
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
MinVersion=10.0
OutputDir=..\..\dist
OutputBaseFilename=strata-desktop-{#AppVersion}-windows-x64-setup
SetupIconFile=strata-desktop.ico
UninstallDisplayIcon={app}\{#AppExe}
UninstallDisplayName={#AppName}
Compression=lzma2/normal
SolidCompression=yes
WizardStyle=modern
; Close a running Strata Desktop (and its engine, the same executable) before files are replaced or removed.
CloseApplications=yes
RestartApplications=no

[Tasks]
Name: "autostart"; Description: "Start {#AppName} at login, in the tray (the engine serves in the background)"; GroupDescription: "At login:"; Flags: unchecked
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[Files]
Source: "{#BundleDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[InstallDelete]
; A new version's bundle replaces the old one entirely (no stale modules beside new ones).
Type: filesandordirs; Name: "{app}\_internal"

[Icons]
Name: "{autoprograms}\{#AppName}"; Filename: "{app}\{#AppExe}"; WorkingDir: "{app}"; Comment: "Local LLM server with a conversation cache"
Name: "{autodesktop}\{#AppName}"; Filename: "{app}\{#AppExe}"; WorkingDir: "{app}"; Tasks: desktopicon
; The same name desktop\autostart.py writes and reads ("Strata Desktop.lnk"): one entry, whichever made it.
Name: "{userstartup}\{#AppName}"; Filename: "{app}\{#AppExe}"; Parameters: "--hidden"; WorkingDir: "{app}"; Comment: "{#AppName} in the tray"; Tasks: autostart

[Run]
Filename: "{app}\{#AppExe}"; Description: "{cm:LaunchProgram,{#AppName}}"; Flags: nowait postinstall skipifsilent

[UninstallRun]
; Ask a running app to quit first (its engine then spills a tiered cache to disk); force only what remains.
Filename: "{sys}\taskkill.exe"; Parameters: "/IM {#AppExe} /T"; Flags: runhidden; RunOnceId: "AskQuit"
; The app's clean stop waits up to 90 s for its engine (desktop/engine_process.py SHUTDOWN_GRACE_S): a tiered cache
; being spilled must not be cut off by the forced kill below. Wait-Process returns as soon as the app has exited.
Filename: "{sys}\WindowsPowerShell\v1.0\powershell.exe"; Parameters: "-NoProfile -NonInteractive -Command ""Wait-Process -Name strata-desktop -Timeout 95 -ErrorAction SilentlyContinue"""; Flags: runhidden; RunOnceId: "WaitQuit"
Filename: "{sys}\taskkill.exe"; Parameters: "/F /IM {#AppExe} /T"; Flags: runhidden; RunOnceId: "ForceQuit"

[UninstallDelete]
; "Start at login" made from the Settings tab (a .lnk, or the .cmd used when PowerShell was unavailable).
Type: files; Name: "{userstartup}\{#AppName}.lnk"
Type: files; Name: "{userstartup}\{#AppName}.cmd"
; Not listed on purpose: %LOCALAPPDATA%\strata (settings, pid file, conversation cache) stays; docs\INSTALL.md
; says how to remove it.
