{{/* The chart's name, or nameOverride. */}}
{{- define "fusestate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The full name of the release's objects: release name, plus the chart name unless the release name has it. */}}
{{- define "fusestate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "fusestate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "fusestate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fusestate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "fusestate.labels" -}}
helm.sh/chart: {{ include "fusestate.chart" . }}
{{ include "fusestate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "fusestate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "fusestate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "fusestate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) }}
{{- end }}

{{/* The volume's name, checked: it becomes a directory name on the host. */}}
{{- define "fusestate.volumeName" -}}
{{- $name := required "volume.name is required" .Values.volume.name | toString }}
{{- if not (regexMatch "^[A-Za-z0-9][A-Za-z0-9._-]*$" $name) }}
{{- fail (printf "volume.name %q: use letters, digits, '.', '_' and '-' only" $name) }}
{{- end }}
{{- $name }}
{{- end }}

{{/* Where the volume is mounted, on the host and (the same path) in the container. */}}
{{- define "fusestate.mountPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.hostMountPath) (include "fusestate.volumeName" .) }}
{{- end }}

{{/* The cache dir of the volume in the container: below the cache volume, mounted on /var/cache/fusestate. */}}
{{- define "fusestate.cacheDir" -}}
{{- printf "/var/cache/fusestate/%s" (include "fusestate.volumeName" .) }}
{{- end }}

{{/* The Secret with the credentials: the user's, or the chart's when it makes one; empty if none. */}}
{{/* "true" when the volume's metadata is in a shared engine (meta.url or meta.existingSecret). */}}
{{- define "fusestate.sharedMeta" -}}
{{- if or .Values.meta.url .Values.meta.existingSecret -}}true{{- end -}}
{{- end }}

{{- define "fusestate.secretName" -}}
{{- if .Values.credentials.existingSecret }}
{{- .Values.credentials.existingSecret }}
{{- else if or .Values.credentials.env .Values.credentials.gcsKeyFile.content }}
{{- printf "%s-credentials" (include "fusestate.fullname" .) }}
{{- end }}
{{- end }}

{{/* Whether the Service in front of the metrics port is made. */}}
{{- define "fusestate.metricsService" -}}
{{- if or .Values.metrics.service.enabled .Values.serviceMonitor.enabled }}true{{ end }}
{{- end }}
