{{/*
The namespace of every namespaced object (the agent's events Role excepted: Node events live in
`default`): the release's.
*/}}
{{- define "edl-agent.namespace" -}}
{{ .Release.Namespace }}
{{- end }}

{{/* The image of both workloads. */}}
{{- define "edl-agent.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/*
Labels of every object's metadata: Helm's usual ones, and part-of as deploy/daemonset sets it.
Pod templates and selectors carry only app.kubernetes.io/name (and component), as in
deploy/daemonset: selectors cannot change after install, and a chart upgrade that changes
nothing in the pods restarts none.
*/}}
{{- define "edl-agent.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | quote }}
app.kubernetes.io/part-of: edl-agent
{{- end }}

{{/* The agent's ServiceAccount as the API server names its user. */}}
{{- define "edl-agent.agentUser" -}}
system:serviceaccount:{{ include "edl-agent.namespace" . }}:edl-agent
{{- end }}

{{/* The intake Service's DNS name: the agents' address and the certificate's name. */}}
{{- define "edl-agent.intakeHost" -}}
edl-restarter.{{ include "edl-agent.namespace" . }}.svc
{{- end }}

{{/* The Secret the agents read the intake's CA from when cert-manager issues it. */}}
{{- define "edl-agent.trustSecret" -}}
edl-restarter-trust
{{- end }}

{{/*
Whether to render a Prometheus Operator object: "true", or "" for no. Called with
(list ENABLED KIND $), ENABLED being serviceMonitor.enabled or prometheusRule.enabled: true
renders it, false never, auto where the cluster serves monitoring.coreos.com/v1/KIND (what
`helm install` and `helm upgrade` learn from the API server, and `helm template` from
--api-versions only).
*/}}
{{- define "edl-agent.monitoring" -}}
{{- $enabled := index . 0 | toString -}}
{{- $api := printf "monitoring.coreos.com/v1/%s" (index . 1) -}}
{{- if eq $enabled "true" -}}
true
{{- else if and (eq $enabled "auto") ((index . 2).Capabilities.APIVersions.Has $api) -}}
true
{{- end -}}
{{- end }}
