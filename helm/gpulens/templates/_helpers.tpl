{{/* Chart name, truncated for use in names and labels. */}}
{{- define "gpulens.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: the release name when it already contains the chart name. */}}
{{- define "gpulens.fullname" -}}
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

{{/* A component's object name: <fullname>-<component>, at most 63 characters. */}}
{{- define "gpulens.componentName" -}}
{{- printf "%s-%s" (include "gpulens.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpulens.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels; call with (dict "root" $ "component" "agent"). */}}
{{- define "gpulens.labels" -}}
helm.sh/chart: {{ include "gpulens.chart" .root }}
{{ include "gpulens.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: gpulens
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels: immutable, so only name, instance and component. */}}
{{- define "gpulens.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpulens.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "gpulens.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "gpulens.tokensSecret" -}}
{{- default (include "gpulens.componentName" (dict "root" . "component" "tokens")) .Values.tokens.existingSecret }}
{{- end }}

{{- define "gpulens.coordinatorClusterRole" -}}
{{- include "gpulens.componentName" (dict "root" . "component" "coordinator") }}
{{- end }}

{{/* Pod-level security for components that need no privileges at all. */}}
{{- define "gpulens.restrictedPodSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "gpulens.restrictedContainerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end }}

{{- define "gpulens.tokensVolume" -}}
- name: tokens
  secret:
    secretName: {{ include "gpulens.tokensSecret" . }}
    defaultMode: 0440
{{- end }}

{{/* Where the node DaemonSet's servers listen: every address, or only the node's IP (listenOnNodeIP). */}}
{{- define "gpulens.nodeListenHost" -}}
{{- if .Values.node.listenOnNodeIP -}}$(GPULENS_NODE_IP){{- else -}}0.0.0.0{{- end -}}
{{- end }}

{{/* The host folder of a file:// archive root ("" for s3://): mounted into the node pod here,
and by the operator into coordinator Pods and analysis Jobs. */}}
{{- define "gpulens.fileArchivePath" -}}
{{- if hasPrefix "file://" .Values.archive.root -}}
{{- trimSuffix "/" (trimPrefix "file://" .Values.archive.root) | default "/" -}}
{{- end -}}
{{- end -}}

{{/* The Dask scheduler analysis Jobs submit to, as they reach it from any namespace: the chart's
own (dask.enabled), else dask.existingScheduler ("" for none: each Job analyses alone). */}}
{{- define "gpulens.daskScheduler" -}}
{{- if .Values.dask.enabled -}}
{{- printf "tcp://%s.%s.svc:%v" (include "gpulens.componentName" (dict "root" . "component" "dask-scheduler")) .Release.Namespace .Values.dask.port -}}
{{- else -}}
{{- .Values.dask.existingScheduler -}}
{{- end -}}
{{- end -}}

{{/* node.nodeSelector without its null entries: a null removes a default key, and `helm upgrade
--reuse-values` hands the null through to the templates (it coalesces the new values with the
old release's already-coalesced ones, which no longer have the key to delete). */}}
{{- define "gpulens.nodeSelector" -}}
{{- $sel := dict }}
{{- range $k, $v := .Values.node.nodeSelector }}
{{- if not (kindIs "invalid" $v) }}{{- $_ := set $sel $k $v }}{{- end }}
{{- end }}
{{- toYaml $sel }}
{{- end }}

{{/* The host folder of exporter.nvml "stub:<folder>" (the CUDA stand-in's NVML view), else nothing. */}}
{{- define "gpulens.nvmlStubPath" -}}
{{- if hasPrefix "stub:" .Values.exporter.nvml -}}
{{- trimPrefix "stub:" .Values.exporter.nvml -}}
{{- end -}}
{{- end -}}
